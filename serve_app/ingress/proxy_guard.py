"""Connection bounds in Serve's HTTP proxy: a deadline for headers, a bound on their size, and a
cap on the connections one client address holds open.

Ray Serve 2.60 runs uvicorn inside its proxy actor and exposes one connection setting,
`http_options.keep_alive_timeout_s` (idle keep-alive; config.yaml sets it). uvicorn itself waits
for a request's headers forever (a connection that sends nothing, or a header a byte a minute,
is held until the client leaves), its httptools parser bounds neither header bytes nor count, and
nothing caps one address's connections. None of that reaches the application (ASGI starts once
the headers are complete), so the RequestGate (serve_app.ingress.gate) cannot bound it; the body
deadline is the gate's (`body_timeout_s`).

Serve's one hook into its proxy process is RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH: a callable
the proxy calls at start, before its uvicorn server is configured, for a list of middlewares.
`install` is that callable: it returns one middleware, serve_app.ingress.unanswered.AnsweredOr503 (a
request whose replica died inside it is answered 503 with Retry-After, not uvicorn's bare 500), and
registers GuardedHttpToolsProtocol as
uvicorn's "auto" HTTP protocol in this process (uvicorn resolves the protocol class by that name
when the server starts). That is the only change to uvicorn, and only in the proxy's process:

- headers must be complete `header_timeout_s` after the connection opens (or after the first byte
  of a later request on a kept-alive connection): else 408 and the connection is closed;
- past `max_header_bytes` of request line and headers: 431, closed;
- past `max_connections_per_client` open connections from one address (the TCP peer: behind a
  load balancer, the balancer's address, so raise it there): the new one is answered 429 and closed.

Settings: serve_app.client_limits.ProxySettings (KVMEM_PROXY_* variables, read in the proxy).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from serve_app.client_limits import ProxySettings
from serve_app.ingress.unanswered import AnsweredOr503

logger = logging.getLogger(__name__)
PROTOCOL_PATH = f"{__name__}:GuardedHttpToolsProtocol"
CALLBACK_VARIABLE = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = f"{__name__}:install"
_LOG_EVERY_S = 10.0


def _response(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status != 429 else "rate_limit_error",
                                 "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n")
    return head.encode() + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of the module docstring."""

    settings = ProxySettings()
    open_per_client: Counter[str] = Counter()  # this process's connections by client address
    _last_log = 0.0

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._awaiting_headers, self._header_bytes, self._header_timer = True, 0, None
        self._counted: str | None = None
        host = self.client[0] if self.client else None
        if host is not None:
            limit = self.settings.max_connections_per_client
            if self.open_per_client[host] >= limit:
                self._note(f"refused a connection from {host}: {limit} already open")
                self._close_with(_response(429, "Too Many Requests", f"this address already holds {limit} open connections "
                                           "(max_connections_per_client)", "too_many_connections", "retry-after: 1\r\n"))
                return
            self.open_per_client[host] += 1
            self._counted = host
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        if self._counted is not None:
            self.open_per_client[self._counted] -= 1
            if self.open_per_client[self._counted] <= 0:
                del self.open_per_client[self._counted]
            self._counted = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        counting = self._awaiting_headers
        super().data_received(data)
        if counting and self._awaiting_headers and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > self.settings.max_header_bytes:
                limit = self.settings.max_header_bytes
                self._close_with(_response(431, "Request Header Fields Too Large",
                                           f"the request line and headers exceed {limit} bytes (max_header_bytes)", "headers_too_large"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._awaiting_headers = True
        if self._header_timer is None:  # a later request on a kept-alive connection: its own deadline
            self._header_bytes = 0
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._header_bytes = 0
        self._disarm_header_timer()
        super().on_headers_complete()

    # ------------------------------------------------------------------ internals
    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.settings.header_timeout_s, self._headers_late)

    def _disarm_header_timer(self) -> None:
        timer, self._header_timer = getattr(self, "_header_timer", None), None
        if timer is not None:
            timer.cancel()

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._awaiting_headers and not self.transport.is_closing():
            seconds = self.settings.header_timeout_s
            self._note(f"closed a connection from {self.client[0] if self.client else '?'}: no complete headers in {seconds:g} s")
            self._close_with(_response(408, "Request Timeout", f"the request headers did not arrive within {seconds:g} s "
                                       "(header_timeout_s)", "request_timeout"))

    def _close_with(self, response: bytes) -> None:
        self._disarm_header_timer()
        self.transport.write(response)
        self.transport.close()

    @classmethod
    def _note(cls, message: str) -> None:
        now = time.monotonic()
        if now - cls._last_log >= _LOG_EVERY_S:  # one line per interval, however many
            cls._last_log = now
            logger.warning("proxy guard: %s", message)


def install() -> list[Any]:
    """RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH's callable: makes GuardedHttpToolsProtocol the
    proxy's uvicorn protocol (settings from KVMEM_PROXY_* now) and returns the AnsweredOr503 middleware."""
    import uvicorn.config
    from starlette.middleware import Middleware

    GuardedHttpToolsProtocol.settings = ProxySettings()
    uvicorn.config.HTTP_PROTOCOLS["auto"] = PROTOCOL_PATH
    logger.info("proxy guard installed: %s", GuardedHttpToolsProtocol.settings.model_dump())
    return [Middleware(AnsweredOr503)]
