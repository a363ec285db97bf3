"""No tenant can hurt another (issue 25), checked without starting the service.

- key creation is strict: unknown fields are refused by name, an admin key needs `"admin": true`,
  `users` must be non-empty otherwise, `{}` is refused (the HTTP model, the key store, the CLI);
- the request gate authenticates before the body is read (a request without a valid key never
  has its body read) and bounds the body while reading it (413, Content-Length or chunked);
- the settings admin key is compared, never stored: a restarted ingress with a rotated key
  refuses the old one, and copies the old code stored are removed at start;
- prefix-cache salts of users and of keys cannot collide, whatever the user id;
- a fact id the service did not mint, or one that names another Redis key, is not found
  (never a Redis error), before Redis is asked.
The same defects through the running service: tests/test_auth.py.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from memory.key_store import KeyStore, hash_key
from serve_app.ingress.auth import Authenticator
from serve_app.settings import AuthSettings

A_KEY = "kvm-settings-admin-key-A-0123456789"
B_KEY = "kvm-settings-admin-key-B-0123456789"


def key_store(redis_server, prefix: str) -> KeyStore:
    return KeyStore.from_url(redis_server.url, prefix, cache_ttl_s=30.0)


def fresh_prefix() -> str:
    return f"guards-{uuid.uuid4().hex[:8]}"


# ------------------------------------------------------------------------------ strict keys
@pytest.mark.parametrize(
    "body, field",
    [({"user": ["bea"]}, "user"), ({}, None), ({"users": []}, "users"), ({"users": None}, None),
     ({"admin": True, "users": ["bea"]}, None), ({"admin": False}, None), ({"users": [""]}, "users.0"),
     ({"admin": "yes"}, "admin"), ({"users": ["bea"], "admin": True, "label": "x"}, None)],
)
def test_key_requests_that_are_not_exactly_one_kind_are_refused(body: dict[str, Any], field: str | None) -> None:
    from serve_app.ingress.auth import NewKeyRequest

    with pytest.raises(ValidationError) as refused:
        NewKeyRequest.model_validate(body)
    if field is not None:
        assert any(".".join(map(str, e["loc"])) == field for e in refused.value.errors()), refused.value.errors()


def test_key_requests_of_one_kind_are_taken() -> None:
    from serve_app.ingress.auth import NewKeyRequest

    assert NewKeyRequest.model_validate({"admin": True}).admin
    user_key = NewKeyRequest.model_validate({"users": ["bea"], "label": "bea's app"})
    assert not user_key.admin and user_key.users == ["bea"]


def test_the_key_store_mints_an_admin_key_only_when_told(redis_server) -> None:
    async def run() -> None:
        store = key_store(redis_server, fresh_prefix())
        try:
            for users in (None, [], ()):
                with pytest.raises((ValueError, TypeError)):
                    await store.create(users)  # no "no users means admin" any more
            with pytest.raises(ValueError):
                await store.create(["bea"], admin=True)
            key, record = await store.create(["bea"])
            assert record.users == ["bea"] and not (await store.principal(key)).is_admin
            key, record = await store.create(admin=True)
            assert record.users is None and (await store.principal(key)).is_admin
        finally:
            await store.close()

    asyncio.run(run())


@pytest.mark.parametrize("argv", [["create"], ["create", "--admin", "--user", "bea"], ["create", "--label", "x"]])
def test_the_keys_cli_needs_admin_or_users(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from serve_app.ingress import keys_cli

    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:9")  # refused before Redis is asked
    with pytest.raises(SystemExit) as refused:
        keys_cli.main(argv)
    assert refused.value.code not in (0, None)


# ------------------------------------------------------------------------------ settings admin key
def test_a_rotated_settings_admin_key_is_refused_after_a_restart(redis_server) -> None:
    """With admin key A configured, then the ingress restarted with key B: A no longer works,
    and neither key ever reaches Redis."""
    import redis

    prefix = fresh_prefix()

    async def run() -> None:
        store = key_store(redis_server, prefix)
        first = Authenticator(AuthSettings(mode="keys", admin_key=A_KEY), store)
        assert (await first.principal(A_KEY)).is_admin
        made, _ = await store.create(["bea"], label="bea")  # an ordinary key, made with A
        await store.close()
        store = key_store(redis_server, prefix)  # the restarted ingress: nothing cached
        second = Authenticator(AuthSettings(mode="keys", admin_key=B_KEY), store)
        assert (await second.principal(B_KEY)).is_admin
        assert not (await second.principal(made)).is_admin  # keys made in the store survive
        with pytest.raises(Exception) as refused:
            await second.principal(A_KEY)
        assert getattr(refused.value, "status_code", None) == 401
        await store.close()

    asyncio.run(run())
    client = redis.Redis.from_url(redis_server.url)
    stored = {k.decode() for k in client.scan_iter(match=f"{prefix}:apikey:*")}
    assert f"{prefix}:apikey:{hash_key(A_KEY)}" not in stored and f"{prefix}:apikey:{hash_key(B_KEY)}" not in stored
    assert len(stored) == 1  # bea's
    client.close()


def test_a_copy_the_old_code_stored_is_removed_at_start(redis_server) -> None:
    import redis

    prefix = fresh_prefix()
    client = redis.Redis.from_url(redis_server.url)
    for key_id, key, label in [("key_000000000001", A_KEY, "admin (settings)"), ("key_000000000002", "kvm-ops", "ops")]:
        client.hset(f"{prefix}:apikey:{hash_key(key)}", mapping={"key_id": key_id, "label": label, "users": "*", "created_at": 1.0})
        client.hset(f"{prefix}:apikeys", key_id, hash_key(key))

    async def run() -> None:
        store = key_store(redis_server, prefix)
        auth = Authenticator(AuthSettings(mode="keys", admin_key=B_KEY), store)
        with pytest.raises(Exception) as refused:
            await auth.principal(A_KEY)
        assert getattr(refused.value, "status_code", None) == 401
        assert (await auth.principal("kvm-ops")).is_admin  # an admin key an admin made stays
        assert [r.label for r in await store.list()] == ["ops"]
        with pytest.raises(ValueError):
            await store.create(admin=True, label="admin (settings)")  # the old label is reserved
        await store.close()

    asyncio.run(run())
    client.close()


# ------------------------------------------------------------------------------ salts
@pytest.mark.parametrize("key_id", ["key_0123456789ab", "admin-settings"])
def test_a_user_named_like_a_key_scope_gets_its_own_salt(key_id: str) -> None:
    from memory.composition import key_salt, user_salt
    from memory.key_store import Principal

    scope = Principal(key_id=key_id, users=frozenset({"bea"})).cache_scope
    for prefix in ("kvmem", "kvmem-auth"):
        key = key_salt(prefix, scope)
        for user in (f"key:{key_id}", scope, key_id, f"{prefix}:key:{key_id}", f"key:{scope}"):
            assert user_salt(prefix, user) != key, (prefix, user)
    assert user_salt("kvmem", "a:b") != user_salt("kvmem:a", "b")  # no separator can be forged
    assert user_salt("kvmem", "bea") == user_salt("kvmem", "bea") != user_salt("kvmem", "ann")


def test_memory_salts_name_the_user_and_the_entries_unambiguously() -> None:
    from kvarena.arena import EntryRef
    from memory.composition import StoredSegment, memory_cache_salt, user_namespace

    def segment(entry: int, generation: int) -> StoredSegment:
        return StoredSegment(EntryRef(entry, generation), (1, 2))

    # user "u|5:1" injecting entry 7 and user "u" injecting entries 5 and 7 share no salt
    forged = memory_cache_salt(user_namespace("kvmem", "u|5:1"), [segment(7, 1)])
    assert forged != memory_cache_salt(user_namespace("kvmem", "u"), [segment(5, 1), segment(7, 1)])


# ------------------------------------------------------------------------------ fact ids
def test_only_ids_of_the_minted_shape_are_fact_ids() -> None:
    from memory.records import is_fact_id, new_fact_id

    minted = new_fact_id()
    assert is_fact_id(minted) and is_fact_id("f" * 32)
    for odd in (f"{minted}:history", minted + "x", minted.upper(), minted[:-1], "", "apikey:" + "a" * 64,
                "user:bea:facts", f"{minted}\n", f" {minted}", "0" * 31 + "g", "\u0661" * 32):
        assert not is_fact_id(odd), odd


def test_the_owner_of_a_key_that_is_no_fact_hash_is_nobody(redis_server) -> None:
    """A fact id naming a key of another type (its history list, a set) was a Redis WRONGTYPE
    error, answered 503, where a made-up id answered 404."""
    import redis

    from memory.directory import UserDirectory

    prefix = fresh_prefix()
    client = redis.Redis.from_url(redis_server.url)
    fact = uuid.uuid4().hex
    client.hset(f"{prefix}:fact:{fact}", "user_id", json.dumps("bea"))
    client.rpush(f"{prefix}:fact:{fact}:history", "{}")
    client.sadd(f"{prefix}:fact:odd", "x")
    client.set(f"{prefix}:fact:plain", "x")
    listed = uuid.uuid4().hex  # of the fact id shape, yet not a hash: WRONGTYPE inside, None outside
    client.rpush(f"{prefix}:fact:{listed}", "x")

    async def run() -> None:
        directory = UserDirectory.from_url(redis_server.url, prefix)
        assert await directory.owner_of_fact(fact) == "bea"
        for odd in (f"{fact}:history", "odd", "plain", listed, uuid.uuid4().hex):
            assert await directory.owner_of_fact(odd) is None, odd
        await directory.close()

    asyncio.run(run())
    client.close()


# ------------------------------------------------------------------------------ the request gate
class Recorder:
    """A downstream ASGI app that records what reached it."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.calls.append({"body": body, "principal": scope.get("state", {}).get("principal")})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})


class FakeKeys:
    async def revoke_settings_copies(self) -> int:
        return 0

    async def principal(self, key: str):
        from memory.key_store import Principal

        return Principal("key_000000000bea", frozenset({"bea"})) if key == "kvm-bea" else None


def gate(max_body_bytes: int = 1000, mode: str = "keys"):
    from serve_app.ingress.gate import RequestGate

    downstream = Recorder()
    from serve_app.client_limits import AdmissionSettings
    from serve_app.ingress.admission import Admission

    ingress = SimpleNamespace(auth=Authenticator(AuthSettings(mode=mode, admin_key=A_KEY), FakeKeys()), max_body_bytes=max_body_bytes,
                              admission=Admission(AdmissionSettings(enabled=False)), body_timeout_s=10.0, max_json_depth=32)
    return RequestGate(downstream, lambda: ingress), downstream


def drive(app, path: str, headers: dict[str, str], chunks: list[bytes]) -> tuple[int, dict[str, Any] | None, int]:
    """One HTTP request through `app`: (status, JSON body or None, how many receive() calls it made)."""
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"", "http_version": "1.1",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    received = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = sent[0]["status"]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return status, json.loads(body) if status != 200 else None, received


@pytest.mark.parametrize("authorization", [None, "Bearer kvm-wrong", "Basic a2V5Og==", "Bearer ", "kvm-bea"])
@pytest.mark.parametrize("chunks", [[b"{not json"], [b"x" * 4_000_000], [b"{", b"}" * 10]])
def test_no_body_is_read_before_the_key_is_valid(authorization: str | None, chunks: list[bytes]) -> None:
    app, downstream = gate()
    headers = {"content-type": "application/json"} | ({"authorization": authorization} if authorization else {})
    status, body, received = drive(app, "/v1/chat/completions", headers, chunks)
    assert (status, received, downstream.calls) == (401, 0, [])
    assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", ["/health", "/docs", "/openapi.json"])
def test_open_paths_need_no_key(path: str) -> None:
    app, downstream = gate()
    assert drive(app, path, {}, [b""])[0] == 200 and downstream.calls[0]["principal"] is None


def test_a_body_over_the_limit_is_refused_while_reading() -> None:
    app, downstream = gate(max_body_bytes=1000)
    key = {"authorization": "Bearer kvm-bea"}
    status, body, received = drive(app, "/v1/memories", key | {"content-length": "1001"}, [b"x" * 1001])
    assert (status, received) == (413, 0)  # told by Content-Length: nothing read
    assert body["error"]["code"] == "request_too_large" and "1000" in body["error"]["message"]
    status, body, received = drive(app, "/v1/memories", key, [b"x" * 400] * 10)  # chunked, no length
    assert status == 413 and received == 3  # stopped at the chunk that crossed the limit
    status, body, received = drive(app, "/v1/memories", key | {"content-length": "10"}, [b"x" * 600, b"y" * 600])
    assert status == 413  # a Content-Length that lies does not help
    assert downstream.calls == []
    status, _, _ = drive(app, "/v1/memories", key, [b"a" * 600, b"b" * 400])
    assert status == 200 and downstream.calls[0]["body"] == b"a" * 600 + b"b" * 400  # at the limit: whole
    assert downstream.calls[0]["principal"].users == frozenset({"bea"})


def test_the_settings_admin_key_and_auth_off_pass_the_gate() -> None:
    app, downstream = gate()
    assert drive(app, "/v1/shards", {"authorization": f"Bearer {A_KEY}"}, [b""])[0] == 200
    assert downstream.calls[-1]["principal"].is_admin
    app, downstream = gate(mode="off")
    assert drive(app, "/v1/shards", {}, [b""])[0] == 200 and downstream.calls[-1]["principal"].is_admin


def test_the_largest_legitimate_request_fits_the_default_body_limit() -> None:
    """The protocols' bounds admit 400,000 characters per request (and 4 KB of metadata); sent \\u-escaped (Python's json
    and `requests` escape every non-ASCII character, 12 bytes for one outside the BMP) with every
    id at its longest, the body must still fit."""
    from serve_app.memory_protocol import MAX_METADATA_BYTES, MAX_TURN_CHARS, MAX_TURNS_PER_ADD, AddMemoryRequest
    from serve_app.protocol import MAX_ID_CHARS, MAX_REQUEST_CHARS, ChatCompletionRequest
    from serve_app.settings import ServiceSettings

    wide = "\U0001f600"
    per_turn = MAX_REQUEST_CHARS // MAX_TURNS_PER_ADD
    add = {"user_id": wide * MAX_ID_CHARS, "source_id": wide * 128,
           "turns": [{"turn_id": wide * 128, "speaker": wide * 128, "text": wide * per_turn, "session_time": wide * 64}
                     for _ in range(MAX_TURNS_PER_ADD)],
           "metadata": {"note": wide * ((MAX_METADATA_BYTES - 20) // 4)}}  # 4 UTF-8 bytes each, at the metadata bound
    chat = {"user": wide * MAX_ID_CHARS, "messages": [{"role": "user", "content": wide * 100_000}] * 4}
    assert per_turn <= MAX_TURN_CHARS
    limit = ServiceSettings().max_body_bytes
    for model, body in ((AddMemoryRequest, add), (ChatCompletionRequest, chat)):
        model.model_validate(body)  # legitimate
        assert len(json.dumps(body).encode()) <= limit, (model.__name__, len(json.dumps(body).encode()))
