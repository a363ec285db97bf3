"""Connection bounds (issue 36) without Ray: the routes' strict query parameters and route-not-found
answers on a FastAPI app built like the service's, and the proxy guard on a real uvicorn server.

- a query parameter a route does not declare is 400 naming it, one given twice is 400; a path no
  route serves is 404 `route_not_found` naming it; no route redirects (both slash forms answer);
- serve_app.ingress.proxy_guard in uvicorn: a connection that does not complete its headers in
  time is answered 408 and closed (nothing sent, or headers dripping); headers past the byte bound
  431; a client address past its connection cap gets 429 and is closed while another address
  (127.0.0.2) is served; kept-alive requests are served as before.
A request the proxy leaves unanswered (its replica died inside it) is 503 with Retry-After
(serve_app.ingress.unanswered).
The same bounds in the running service (Serve's proxy loading the guard): tests/test_hostile_serve.py.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from fastapi import Query
from fastapi.testclient import TestClient

from devtools.local_redis import free_loopback_port
from serve_app.client_limits import ProxySettings
from serve_app.ingress.errors import install_error_handlers
from serve_app.ingress.strict_routes import register, strict_app


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = strict_app()
    install_error_handlers(app)

    @register(app, "GET", "/v1/things")
    async def things(user_id: str = Query(...), limit: int = Query(10)) -> dict[str, object]:
        return {"user_id": user_id, "limit": limit}

    @register(app, "POST", "/v3/things/")
    async def post_things() -> dict[str, str]:
        return {"ok": "yes"}

    return TestClient(app, follow_redirects=False)


def test_declared_query_parameters_are_taken_in_both_slash_forms(client: TestClient) -> None:
    for path in ("/v1/things", "/v1/things/"):
        answer = client.get(path, params={"user_id": "bea", "limit": 3})
        assert answer.status_code == 200 and answer.json() == {"user_id": "bea", "limit": 3}
    for path in ("/v3/things/", "/v3/things"):
        assert client.post(path).status_code == 200  # never a 307 whose Location comes from Host


@pytest.mark.parametrize("query, param, code", [
    ("user_id=bea&delete_linked=true", "delete_linked", "unsupported_parameter"),
    ("user_id=bea&api_key=kvm-x", "api_key", "unsupported_parameter"),
    ("userid=bea", "userid", "unsupported_parameter"),
    ("user_id=bea&user_id=cal", "user_id", "repeated_parameter"),
])
def test_undeclared_or_repeated_query_parameters_are_refused_by_name(client: TestClient, query: str, param: str, code: str) -> None:
    answer = client.get(f"/v1/things?{query}")
    error = answer.json()["error"]
    assert answer.status_code == 400 and (error["param"], error["code"]) == (param, code), error
    assert param in error["message"]


def test_a_path_no_route_serves_is_route_not_found(client: TestClient) -> None:
    answer = client.delete("/v1/memories/abc/everything")
    error = answer.json()["error"]
    assert answer.status_code == 404 and error["code"] == "route_not_found"
    assert error["message"] == "no route DELETE /v1/memories/abc/everything"
    answer = client.delete("/v1/things")
    assert answer.status_code == 405 and answer.json()["error"]["code"] == "method_not_allowed"


# ------------------------------------------------------------------------------ the proxy guard
async def hello(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture()
def guarded() -> Iterator[tuple[int, type]]:
    """A uvicorn server on a free loopback port with the guard's protocol, as install() sets it in Serve's proxy."""
    import uvicorn

    from serve_app.ingress.proxy_guard import GuardedHttpToolsProtocol

    port = free_loopback_port()
    saved = GuardedHttpToolsProtocol.settings
    GuardedHttpToolsProtocol.settings = ProxySettings(header_timeout_s=0.6, max_header_bytes=2048, max_connections_per_client=3)
    server = uvicorn.Server(uvicorn.Config(hello, host="127.0.0.1", port=port, http=GuardedHttpToolsProtocol, log_level="warning",
                                           lifespan="off", timeout_keep_alive=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield port, GuardedHttpToolsProtocol
    finally:
        server.should_exit = True
        thread.join(10)
        GuardedHttpToolsProtocol.settings = saved


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (a timeout fails the test)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_connection_without_complete_headers_is_answered_408_and_closed(guarded: tuple[int, type]) -> None:
    port, _ = guarded
    silent = connect(port)
    dripping = connect(port)
    started = time.monotonic()
    dripping.sendall(b"POST /v1/memories HTTP/1.1\r\nHost: x\r\n")
    time.sleep(0.3)
    dripping.sendall(b"Content-Type: application/json\r\n")
    for sock in (silent, dripping):
        answer = read_all(sock)
        assert answer.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in answer
    assert time.monotonic() - started < 3.0


def test_headers_past_the_byte_bound_are_431(guarded: tuple[int, type]) -> None:
    port, _ = guarded
    sock = connect(port)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4000)
    assert read_all(sock).startswith(b"HTTP/1.1 431 ")


def test_an_address_past_its_connection_cap_is_refused_while_another_is_served(guarded: tuple[int, type]) -> None:
    port, protocol = guarded
    protocol.settings = protocol.settings.model_copy(update={"header_timeout_s": 30.0})
    held = [connect(port) for _ in range(3)]
    time.sleep(0.2)
    refused = connect(port)
    answer = read_all(refused)
    assert answer.startswith(b"HTTP/1.1 429 ") and b'"too_many_connections"' in answer
    other = connect(port, source="127.0.0.2")  # another client: served
    other.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert other.recv(65536).startswith(b"HTTP/1.1 200 ")
    other.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # kept alive: a second request on it
    assert other.recv(65536).startswith(b"HTTP/1.1 200 ")
    held.pop().close()
    time.sleep(0.2)
    again = connect(port)  # one freed: the address may open one again
    again.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert read_all(again).startswith(b"HTTP/1.1 200 ")
    for sock in held + [other]:
        sock.close()


# ------------------------------------------------------------------------------ a replica lost mid-request
async def silent(scope, receive, send) -> None:
    """What Serve's proxy app does when the replica dies inside a request: returns without answering."""


async def crashing(scope, receive, send) -> None:
    raise RuntimeError("a bug")


def test_what_the_proxy_leaves_unanswered_is_503_with_retry_after_and_answers_pass() -> None:
    from serve_app.ingress.proxy_guard import install
    from serve_app.ingress.unanswered import AnsweredOr503

    import uvicorn.config

    saved = dict(uvicorn.config.HTTP_PROTOCOLS)
    try:
        middlewares = install()  # what Serve's proxy applies, as http_util._apply_middlewares does
    finally:
        uvicorn.config.HTTP_PROTOCOLS.clear()
        uvicorn.config.HTTP_PROTOCOLS.update(saved)  # install() sets this process's uvicorn protocol
    assert [m.cls for m in middlewares] == [AnsweredOr503]
    wrap = lambda app: middlewares[0].cls(app, **middlewares[0].kwargs)  # noqa: E731
    before = AnsweredOr503.answered_503
    answer = TestClient(wrap(silent)).post("/v1/chat/completions", json={})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["code"] == "replica_unavailable"
    assert AnsweredOr503.answered_503 == before + 1
    answer = TestClient(wrap(hello)).get("/health")
    assert (answer.status_code, answer.text) == (200, "ok")  # an answer passes untouched
    assert AnsweredOr503.answered_503 == before + 1
    with pytest.raises(RuntimeError, match="a bug"):  # an exception stays one (uvicorn's 500 says so)
        TestClient(wrap(crashing)).get("/health")
