"""RequestGate: the ASGI middleware that admits a request before any route reads its body.

FastAPI reads and parses a route's body before the route's dependencies run, so a key checked in
a dependency comes too late: a malformed body without a key got 400, and a 4 MB body without a
key was read and parsed in full. The gate runs before routing, on the raw request:

1. every path but OPEN_PATHS needs a valid key (serve_app.ingress.auth.Authenticator, from the
   `Authorization: Bearer` or Mem0's `Token` header alone): 401 (or 503 while the key store cannot answer) without
   one receive() of the body;
2. admission (serve_app.ingress.admission): the key's (or its one user's) rate for the request's
   class and its in-flight caps, 429 with Retry-After before one receive() of the body; a key
   that ignores Retry-After has its refusals held a while (no parse, no Ray call meanwhile);
3. the body is bounded while it is read: in size (`max_body_bytes`: 413 at once when
   Content-Length says more, else as soon as the bytes received cross it) and in time
   (`body_timeout_s`: 408 and Connection: close when the whole body has not arrived by then: a
   client that declares 1,000 bytes and sends 10 no longer holds its request forever);
4. a body nested deeper than `max_json_depth` is refused (400 naming the field) before anything
   parses it (serve_app.ingress.body_depth);
5. the admitted request goes on with the Principal in `request.state.principal` (the routes read
   it there) and its body replayed from the bytes read; its in-flight slot is freed when it is answered.
Errors are OpenAI-shaped (serve_app.ingress.errors). The gate sits on the routes' FastAPI app, so
both routing modes (ChatAPI, or each LLM replica with `routing: direct`) are gated alike. What the
gate cannot see (a connection that never completes its headers, how many connections an address
holds) is bounded in Serve's proxy: serve_app.ingress.proxy_guard.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, MutableMapping, Protocol

from fastapi import HTTPException

from serve_app.ingress.admission import Admission, Refused, Ticket, request_class
from serve_app.ingress.auth import Authenticator
from serve_app.ingress.body_depth import too_deep
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
    admission: Admission
    max_body_bytes: int
    body_timeout_s: float
    max_json_depth: int


class BodyTooLarge(Exception):
    pass


def _route_path(scope: Scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


def _connection(scope: Scope) -> str | None:
    """The client's address and port (Serve's proxy passes its connection's), or None."""
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else None


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
        ticket = Ticket()
        path = _route_path(scope)
        if path not in OPEN_PATHS:
            started = time.perf_counter()
            try:
                principal = state["principal"] = await ingress.auth.principal(api_key_of(_header(scope, b"authorization")))
            except HTTPException as refused:
                address = (scope.get("client") or (None,))[0]
                hold = ingress.admission.unauthenticated_hold(address) if refused.status_code == 401 else 0.0
                if hold > 0:  # calling again at once without a valid key: paced, as a key ignoring Retry-After is
                    async with ingress.admission.held(f"address:{address}"):
                        await asyncio.sleep(hold)
                await self._refuse(scope, receive, send, refused.status_code, str(refused.detail), dict(refused.headers or {}))
                return
            state["auth_ms"] = (time.perf_counter() - started) * 1e3
            kind = state["request_class"] = request_class(scope.get("method", "GET"), path)
            try:
                ticket = ingress.admission.admit(principal, kind, _connection(scope))
            except Refused as refused:
                await self._answer_refusal(ingress.admission, principal.key_id, refused, scope, receive, send)
                return
        try:
            body = await self._bounded_body(ingress, scope, receive, send)
            if body is not None:
                await self.app(scope, self._replay(body, receive), send)
        finally:
            ingress.admission.release(ticket)

    async def _bounded_body(self, ingress: Gated, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The body, or None once the client is gone or the request has been answered (413, 408, 400)."""
        limit = ingress.max_body_bytes
        try:
            declared = int(_header(scope, b"content-length") or 0)
        except ValueError:
            declared = 0  # uvicorn refuses a malformed Content-Length before the app; counted below anyway
        close = {"Connection": "close"}
        try:
            if declared > limit:
                raise BodyTooLarge
            async with asyncio.timeout(ingress.body_timeout_s):
                body = await self._read(receive, limit)
        except BodyTooLarge:
            message = f"the request body is larger than this service accepts ({limit} bytes)"
            await error_response(413, message, code="request_too_large", headers=close)(scope, receive, send)
            return None
        except TimeoutError:
            message = f"the request body did not arrive within {ingress.body_timeout_s:g} s (body_timeout_s)"
            await error_response(408, message, code="request_timeout", headers=close)(scope, receive, send)
            return None
        if body is None:
            return None  # the client went away while sending
        deep = too_deep(body, ingress.max_json_depth)
        if deep is not None:
            depth, where = deep
            field = f"{where}: " if where else "the request body: "
            message = f"{field}nested {depth} levels of arrays and objects deep; at most {ingress.max_json_depth} (max_json_depth)"
            await error_response(400, message, param=where, code="nested_too_deep")(scope, receive, send)
            return None
        return body

    @staticmethod
    def _replay(body: bytes, receive: Receive) -> Receive:
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: http.disconnect, as the app expects

        return replay

    @staticmethod
    async def _answer_refusal(admission: Admission, key_id: str, refused: Refused, scope: Scope, receive: Receive, send: Send) -> None:
        """429 for a refused admission, after its hold (a key calling again before its Retry-After)."""
        if refused.hold_s > 0:
            async with admission.held(key_id):
                await asyncio.sleep(refused.hold_s)
        await error_response(429, refused.message, code=refused.code, headers=refused.headers())(scope, receive, send)

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
