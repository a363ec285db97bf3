"""A request Serve's proxy leaves unanswered is answered 503 with Retry-After.

With `routing: direct`, Serve's proxy sends each request straight to an LLM replica. When that
replica's process dies while a request is inside it (a crash, an OOM kill, a node lost), the proxy
gets RayActorError and, for any error but 408/429/503, sends no answer of its own
(ray.serve._private.http_util.send_http_response_on_exception returns no messages): uvicorn then
answers a bare `500 Internal Server Error`. The request never ran to the end, the shard's other
replica is up, and a retry would be served: that is a 503 with Retry-After, which clients (and the
fault bench, bench.serve.faults_parts.bad_statuses) treat as "try again", not a server bug.

AnsweredOr503 wraps the proxy's ASGI app (installed by serve_app.ingress.proxy_guard.install, the
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH callable): an HTTP request whose app returned without
starting a response gets that 503. Any answer the app started passes untouched; an exception the app
raises is not caught (uvicorn's 500 then says a bug is a bug); a client that has left gets nothing
(uvicorn drops sends after a disconnect).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Awaitable, Callable

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

RETRY_AFTER_S = 1
BODY = json.dumps({"error": {
    "message": "the replica serving this request stopped before it answered; the shard's other replicas (or its "
               "replacement) serve a retry",
    "type": "service_unavailable", "param": None, "code": "replica_unavailable"}}).encode()


class AnsweredOr503:
    """ASGI middleware: see the module docstring. Counts the requests it answered (`answered_503`)."""

    answered_503 = 0  # this process's count, read by tests and logged

    def __init__(self, app: ASGIApp, retry_after_s: int = RETRY_AFTER_S) -> None:
        self.app = app
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message.get("type") == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, receive, tracked)
        if started:
            return
        type(self).answered_503 += 1
        logger.warning("no answer from the replica for %s %s: answered 503 (replica_unavailable)", scope.get("method"), scope.get("path"))
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode()),
            (b"retry-after", str(self.retry_after_s).encode())]})
        await send({"type": "http.response.body", "body": BODY})


__all__ = ["AnsweredOr503"]
