"""RequestGate: the ASGI middleware that admits a request before any route reads its body.

FastAPI reads and parses a route's body before the route's dependencies run, so a key checked in
a dependency comes too late: a malformed body without a key got 400, and a 4 MB body without a
key was read and parsed in full. The gate runs before routing, on the raw request:

1. every path but OPEN_PATHS needs a valid key (serve_app.ingress.auth.Authenticator, from the
   `Authorization: Bearer` or Mem0's `Token` header alone): 401 (or 503 while the key store cannot answer) without
   one receive() of the body;
2. the body is bounded while it is read (`max_body_bytes`, serve_app.settings): 413 at once when
   Content-Length says more, else as soon as the bytes received (chunked or not, whatever
   Content-Length claimed) cross it, before anything parses them;
3. the admitted request goes on with the Principal in `request.state.principal` (the routes read
   it there) and its body replayed from the bytes read.
Errors are OpenAI-shaped (serve_app.ingress.errors). The gate sits on the routes' FastAPI app, so
both routing modes (ChatAPI, or each LLM replica with `routing: direct`) are gated alike.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, MutableMapping, Protocol

from fastapi import HTTPException

from serve_app.ingress.auth import Authenticator
from serve_app.ingress.errors import error_response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class Gated(Protocol):
    """What the gate needs of the ingress it guards (serve_app.ingress.routes.ChatRoutes)."""

    auth: Authenticator
    max_body_bytes: int


class BodyTooLarge(Exception):
    pass


def _route_path(scope: Scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


API_KEY_SCHEMES = ("bearer", "token")  # OpenAI's clients send Bearer, Mem0's Token


def api_key_of(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` or `Token <key>` header (scheme case-insensitive), else None."""
    scheme, _, key = (authorization or "").strip().partition(" ")
    return (key.strip() or None) if scheme.lower() in API_KEY_SCHEMES else None


class RequestGate:
    """The middleware (see the module docstring). `ingress()` gives the guarded ingress: in a Serve
    replica, the replica's own ChatRoutes (serve_app.ingress.routes.serving_ingress)."""

    def __init__(self, app: ASGIApp, ingress: Callable[[], Gated]) -> None:
        self.app = app
        self.ingress = ingress

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ingress = self.ingress()
        state = scope["state"] = dict(scope.get("state") or {})  # this request's own (a server may share one)
        if _route_path(scope) not in OPEN_PATHS:
            started = time.perf_counter()
            try:
                state["principal"] = await ingress.auth.principal(api_key_of(_header(scope, b"authorization")))
            except HTTPException as refused:
                await self._refuse(scope, receive, send, refused.status_code, str(refused.detail), dict(refused.headers or {}))
                return
            state["auth_ms"] = (time.perf_counter() - started) * 1e3
        limit = ingress.max_body_bytes
        try:
            declared = int(_header(scope, b"content-length") or 0)
        except ValueError:
            declared = 0  # uvicorn refuses a malformed Content-Length before the app; counted below anyway
        try:
            if declared > limit:
                raise BodyTooLarge
            body = await self._read(receive, limit)
        except BodyTooLarge:
            message = f"the request body is larger than this service accepts ({limit} bytes)"
            await error_response(413, message, code="request_too_large", headers={"Connection": "close"})(scope, receive, send)
            return
        if body is None:
            return  # the client went away while sending
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: http.disconnect, as the app expects

        await self.app(scope, replay, send)

    @staticmethod
    async def _read(receive: Receive, limit: int) -> bytes | None:
        """The whole body (at most `limit` bytes; BodyTooLarge past it), or None on a disconnect."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str, headers: dict[str, str]) -> None:
        code = "invalid_api_key" if status == 401 else None
        await error_response(status, message, code=code, headers=headers or None)(scope, receive, send)
