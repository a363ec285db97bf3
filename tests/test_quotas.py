"""Per-user quotas and Redis's memory limit in the store (issue 25), on a real redis-server.

- a write past a quota (facts, turns, bytes of text) is refused whole and stores nothing; a
  delete frees what it removed; a batch is checked whole before its first write;
- the counters live in Redis beside the records (a second FactStore, as after a restart or on
  another replica, sees the same use), and a user stored before they existed has them derived;
- the Redis this project starts runs with maxmemory and policy noeviction, and a write it refuses
  for memory changes nothing.
The same through the running service (429, 413, 507, the warning): tests/test_quota_service.py.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import redis

from devtools.local_redis import LocalRedis
from memory.fact_store import FactStore
from memory.quota import Usage, redis_memory_report
from memory.settings import QuotaSettings
from memory.records import NewFact, QuotaExceeded, Turn

EMBEDDING = np.zeros(4, dtype=np.float32)


def store(redis_server: LocalRedis, **limits: int) -> FactStore:
    quota = QuotaSettings(**{"max_facts": 0, "max_turns": 0, "max_text_bytes": 0, **limits})
    return FactStore.from_url(redis_server.url, f"quota-{uuid.uuid4().hex[:8]}", quota=quota)


def fact(text: str) -> NewFact:
    return NewFact(text=text, source_id=None)


def test_a_fact_past_the_quota_is_refused_and_stores_nothing_and_a_delete_frees_it(redis_server: LocalRedis) -> None:
    facts = store(redis_server, max_facts=2)
    first, _ = facts.add("ana", fact("Ana keeps bees."), EMBEDDING)
    facts.add("ana", fact("Ana rows on Sundays."), EMBEDDING)
    before = set(facts.r.keys(f"{facts.p}:*"))
    with pytest.raises(QuotaExceeded) as refused:
        facts.add("ana", fact("Ana paints."), EMBEDDING)
    assert (refused.value.quota, refused.value.used, refused.value.limit) == ("facts", 2, 2)
    assert "2 of 2 facts" in str(refused.value) and refused.value.param == "memory.quota.max_facts"
    assert set(facts.r.keys(f"{facts.p}:*")) == before and len(facts.fact_ids("ana")) == 2
    _, created = facts.add("ana", fact("Ana keeps bees."), EMBEDDING)  # already stored: no quota taken
    assert not created
    facts.add("bo", fact("Bo paints."), EMBEDDING)  # quotas are per user
    facts.delete(first.fact_id, "ana")
    assert facts.usage("ana").facts == 1
    facts.add("ana", fact("Ana paints."), EMBEDDING)
    assert facts.usage("ana") == Usage(facts=2, turns=0, text_bytes=len("Ana rows on Sundays.Ana paints."))


def test_text_bytes_count_turns_and_facts_and_updates(redis_server: LocalRedis) -> None:
    facts = store(redis_server, max_text_bytes=100)
    facts.add_turns("cy", [Turn(turn_id="t1", speaker="cy", text="é" * 20, order=0)])  # 40 UTF-8 bytes
    record, _ = facts.add("cy", fact("x" * 40), EMBEDDING)
    assert facts.usage("cy") == Usage(facts=1, turns=1, text_bytes=80)
    with pytest.raises(QuotaExceeded, match="80 of 100 text_bytes"):
        facts.add_turns("cy", [Turn(turn_id="t2", speaker="cy", text="y" * 21, order=1)])
    with pytest.raises(QuotaExceeded):
        facts.update(record.fact_id, "cy", "x" * 61, EMBEDDING)
    assert facts.get(record.fact_id).text == "x" * 40 and facts.r.hlen(facts.keys.user("cy", "turns")) == 1
    facts.update(record.fact_id, "cy", "x" * 10, EMBEDDING)  # shrinking frees
    facts.add_turns("cy", [Turn(turn_id="t1", speaker="cy", text="z", order=0)])  # a replaced turn frees its old text
    assert facts.usage("cy") == Usage(facts=1, turns=1, text_bytes=11)


def test_metadata_is_kept_with_its_fact_and_counted_as_text(redis_server: LocalRedis) -> None:
    facts = store(redis_server, max_text_bytes=100)
    tags = {"topic": "bees", "n": 1}  # {"topic":"bees","n":1}: 22 bytes of compact JSON
    record, _ = facts.add("di", NewFact(text="Di keeps bees.", metadata=tags), EMBEDDING)  # 14 + 22 bytes
    assert facts.get(record.fact_id, "di").metadata == tags and facts.usage("di").text_bytes == 36
    updated = facts.update(record.fact_id, "di", "Di keeps bees.", EMBEDDING, metadata={"topic": "é" * 10})  # 14 + 32
    assert updated.metadata == {"topic": "é" * 10} and facts.get(record.fact_id, "di").metadata == updated.metadata
    assert facts.usage("di").text_bytes == 46
    assert facts.update(record.fact_id, "di", "Di keeps two hives.", EMBEDDING).metadata == updated.metadata  # None keeps it
    with pytest.raises(QuotaExceeded):  # metadata counts like text: 19 + 32 + 54 > 100
        facts.add("di", NewFact(text="Di rows.", metadata={"note": "x" * 35}), EMBEDDING)
    assert facts.usage("di").text_bytes == 51
    facts.r.delete(facts.quota.usage_key("di"))  # the counters derived from the records count the metadata too
    assert facts.usage("di").text_bytes == 51
    facts.delete(record.fact_id, "di")
    assert facts.usage("di").text_bytes == 0 and facts.r.hget(f"{facts.p}:fact:{record.fact_id}", "metadata") is None


def test_a_batch_is_checked_whole_before_its_first_write(redis_server: LocalRedis) -> None:
    facts = store(redis_server, max_facts=3, max_turns=2)
    facts.add("di", fact("Di sails."), EMBEDDING)
    facts.check_room("di", [fact("Di sails."), fact("Di sings."), fact("Di swims.")])  # one is stored already
    with pytest.raises(QuotaExceeded, match="1 of 3 facts"):
        facts.check_room("di", [fact("Di sings."), fact("Di swims."), fact("Di skis.")])
    turns = [Turn(turn_id=f"t{i}", speaker="di", text="hi", order=i) for i in range(3)]
    with pytest.raises(QuotaExceeded, match="0 of 2 turns"):
        facts.check_room("di", turns=turns)
    with pytest.raises(QuotaExceeded):
        facts.add_turns("di", turns)
    assert facts.r.hlen(facts.keys.user("di", "turns")) == 0


def test_the_use_is_kept_in_redis_across_stores_and_derived_for_older_users(redis_server: LocalRedis) -> None:
    facts = store(redis_server, max_facts=5)
    facts.add_turns("ed", [Turn(turn_id="t1", speaker="ed", text="hello", order=0)])
    facts.add("ed", fact("Ed fences."), EMBEDDING)
    restarted = FactStore.from_url(redis_server.url, facts.p, quota=facts.quota.settings)
    assert restarted.usage("ed") == facts.usage("ed") == Usage(facts=1, turns=1, text_bytes=len("helloEd fences."))
    facts.r.delete(facts.quota.usage_key("ed"))  # a user stored before the counters existed
    assert restarted.usage("ed") == Usage(facts=1, turns=1, text_bytes=len("helloEd fences."))
    restarted.delete_all("ed")
    assert not facts.r.exists(facts.quota.usage_key("ed")) and restarted.usage("ed") == Usage()


def test_the_redis_the_project_starts_refuses_writes_when_full_and_changes_nothing(tmp_path: Path) -> None:
    with LocalRedis(tmp_path / "redis", appendonly=False, maxmemory="64mb") as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert int(client.config_get("maxmemory")["maxmemory"]) == 64 * 2**20
        facts = FactStore.from_url(server.url, "full")
        facts.add("fay", fact("Fay climbs."), EMBEDDING)
        before = {key: client.type(key) for key in client.keys("full:*")}
        usage = facts.usage("fay")
        client.config_set("maxmemory", 1)  # Redis is full
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            facts.add("fay", fact("Fay dives."), EMBEDDING)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            facts.add_turns("fay", [Turn(turn_id="t1", speaker="fay", text="hi", order=0)])
        client.config_set("maxmemory", 64 * 2**20)
        assert {key: client.type(key) for key in client.keys("full:*")} == before and facts.usage("fay") == usage


def test_the_memory_report_warns_past_the_fraction() -> None:
    assert "warning" not in redis_memory_report(79, 100, 0.8)
    report = redis_memory_report(85, 100, 0.8)
    assert report["fraction"] == 0.85 and "85%" in report["warning"] and "507" in report["warning"]
    assert redis_memory_report(85, 0, 0.8) == {"used_bytes": 85, "max_bytes": 0, "fraction": None}
