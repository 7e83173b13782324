"""A shared secret on every route of the vLLM servers the trainer uses (vLLM's ``--middleware`` hook).

vLLM's development routes (``/collective_rpc`` ``reload_weights``, ``/update_weight_version``,
``/pause``), which the weight sync needs, take no key: ``--api-key`` guards ``/v1/*`` only. Whoever
could open a connection to the port could load weights of their own and set the version label, and
the run would record samples of those weights as its policy's. :class:`SecretMiddleware` wraps the
whole ASGI application, so it sees every request before any route does — the development routes,
``/v1/*``, ``/health``, ``/metrics``, the docs, and any route a later vLLM adds — and answers one
without ``Authorization: Bearer <secret>`` with 401 (a websocket is closed with code 1008).

No route is exempt, ``/health`` included: the trainer, its launcher and its liveness probe send the
secret anyway, an exemption list would have to follow every vLLM release, and nothing but the
trainer has a reason to reach these servers. The secret comes from the server's environment
(:data:`API_KEY_ENV`), never from its command line, which every user of the machine can read
(``ps``); a server whose environment has none refuses to start.

The module imports nothing from vLLM or torch: it is plain ASGI, tested without a server.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

#: Environment variable with the secret: read by the server (this middleware), the by-hand
#: launcher and :class:`~brace_lightning.rollout.vllm_server.VLLMServerEngine` (for ``urls``).
API_KEY_ENV = "BRACE_VLLM_API_KEY"
#: The ``--middleware`` import path that ``vllm serve`` is given.
MIDDLEWARE = f"{__name__}.SecretMiddleware"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def bearer_header(secret: str) -> dict[str, str]:
    """The request header that carries ``secret`` (the OpenAI clients' API-key header)."""
    return {"Authorization": f"Bearer {secret}"}


class SecretMiddleware:
    """Refuse every HTTP request and websocket that lacks ``Authorization: Bearer <secret>``.

    Args:
        app: the application it guards (vLLM's FastAPI app).
        secret: the shared secret; None reads it from the environment (:data:`API_KEY_ENV`),
            which is how ``vllm serve --middleware`` constructs it.

    Raises:
        ValueError: when there is no secret (an empty one included): the server must not start
            unguarded.
    """

    def __init__(self, app: ASGIApp, secret: str | None = None) -> None:
        if secret is None:
            secret = os.environ.get(API_KEY_ENV)
        if not secret:
            raise ValueError(
                f"SecretMiddleware got no secret ({API_KEY_ENV} is unset or empty); expected the "
                "shared secret in the server's environment."
            )
        self.app = app
        self._digest = hashlib.sha256(secret.encode()).digest()

    def authorized(self, scope: Scope) -> bool:
        """Whether ``scope``'s headers carry the secret (compared in constant time)."""
        for name, value in scope.get("headers") or ():
            if bytes(name).lower() != b"authorization":
                continue
            scheme, _, token = bytes(value).partition(b" ")
            if scheme.lower() == b"bearer":
                digest = hashlib.sha256(token.strip()).digest()
                return hmac.compare_digest(digest, self._digest)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.authorized(scope):
            await self.app(scope, receive, send)  # "lifespan": the server's own start and stop
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        body = json.dumps({"error": "Unauthorized: expected the server's API key"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
