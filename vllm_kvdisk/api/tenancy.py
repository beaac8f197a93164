"""The tenancy gate: an ASGI middleware that sets each generation request's ``cache_salt``
to its tenant's (:mod:`vllm_kvdisk.core.tenancy`) before vLLM parses the body.

The kvdisk endpoint plugin adds it to vLLM's app while the app is built; vLLM's own
authentication middleware is added after it and so runs first: a request with a wrong key
is refused before its body is read here. The gate is inert until the plugin configures it
from the engine's kvdisk settings. It rewrites the JSON body of the endpoints whose requests
carry a ``cache_salt`` (the salt partitions vLLM's device prefix cache as well as kvdisk's
namespaces), and leaves the salt it chose in the request's state (``kvdisk_cache_salt``) for
endpoints without the field (``/tokenize``, which shows a replayed prompt). A body that is
not a JSON object passes unchanged (vLLM answers it with its own error).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.core.tenancy import TenancyRefused, effective_salt, tenant_of

log = get_logger(__name__)

# Routes whose request bodies have a ``cache_salt`` field (vLLM's OpenAI, Anthropic and
# token-in/token-out generation routes, and the pooling routes, which share the prefix cache).
SALTED_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/inference/v1/generate",
    "/v1/embeddings",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/v1/kvdisk/prewarm",  # kvdisk's own (api/prewarm.py): a chat body
)
STATE_ONLY_ROUTES = ("/tokenize",)
STATE_KEY = "kvdisk_cache_salt"

# The ASGI interface, as far as the gate uses it.
Message = dict[str, Any]
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class TenancyGate:
    """The settings the middleware applies; None until the plugin reads them."""

    def __init__(self) -> None:
        self.source: str | None = None
        self.header = ""
        self.required = False

    def configure(self, source: str, header: str, required: bool) -> None:
        self.source, self.header, self.required = source, header, required

    @property
    def active(self) -> bool:
        return self.source is not None and (self.source != "none" or self.required)


class TenancyMiddleware:
    def __init__(self, app: App, gate: TenancyGate) -> None:
        self.app, self.gate = app, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or not self.gate.active:
            return await self.app(scope, receive, send)
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        rewrite = path in SALTED_ROUTES
        if not rewrite and path not in STATE_ONLY_ROUTES:
            return await self.app(scope, receive, send)
        body, more, tail = await _read_body(receive)
        if tail is not None:  # the client went away mid-body: let vLLM see what came
            return await self.app(scope, _replay(body, more, receive, tail), send)
        try:
            request = json.loads(body) if body else None
        except ValueError:
            request = None
        if not isinstance(request, dict):
            return await self.app(scope, _replay(body, False, receive), send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        tenant = tenant_of(headers, self.gate.source or "none", self.gate.header)
        client_salt = request.get("cache_salt")
        try:
            salt = effective_salt(
                tenant,
                client_salt if isinstance(client_salt, str) else None,
                required=self.gate.required,
            )
        except TenancyRefused as exc:
            return await _refuse(send, str(exc))
        scope.setdefault("state", {})[STATE_KEY] = salt
        if (
            rewrite
            and salt != client_salt
            and (client_salt is None or isinstance(client_salt, str))
        ):
            if salt is None:
                request.pop("cache_salt", None)
            else:
                request["cache_salt"] = salt
            body = json.dumps(request).encode()
            scope = dict(scope)
            scope["headers"] = [
                (k, v) for k, v in scope["headers"] if k.lower() != b"content-length"
            ] + [(b"content-length", str(len(body)).encode())]
        return await self.app(scope, _replay(body, False, receive), send)


async def _read_body(receive: Receive) -> tuple[bytes, bool, Message | None]:
    """The whole body, or what came before another message (a disconnect)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message.get("type") != "http.request":
            return b"".join(chunks), True, message
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), False, None


def _replay(body: bytes, more: bool, receive: Receive, tail: Message | None = None) -> Receive:
    """A ``receive`` that hands the body over once, then what the client sends next."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": more}]
    if tail is not None:
        pending.append(tail)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


async def _refuse(send: Send, message: str) -> None:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "BadRequestError",
                "param": "cache_salt",
                "code": 400,
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
