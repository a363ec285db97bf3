"""FactStore on a real Redis: durable records, de-duplication, history, isolation, windows."""

from __future__ import annotations

import numpy as np
import pytest

from memory.fact_store import FactStore
from memory.records import NewFact, Turn, UnknownFact


@pytest.fixture()
def store(redis_client) -> FactStore:
    return FactStore(redis_client, prefix="t")


def _vec(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
    return v / np.linalg.norm(v)


def test_add_get_and_dedupe(store: FactStore) -> None:
    record, created = store.add("alice", NewFact(text=" Alice has a dog named Rex. ", source_id="D1:2"), _vec(0))
    assert created and record.text == "Alice has a dog named Rex." and record.version == 1
    again, created_again = store.add("alice", NewFact(text="Alice has a dog named Rex.", source_id="D1:2"), _vec(1))
    assert not created_again and again.fact_id == record.fact_id
    assert [r.fact_id for r in store.get_all("alice")] == [record.fact_id]
    got, embedding = store.get_with_embedding(record.fact_id, "alice")
    assert got == record
    np.testing.assert_array_equal(embedding, _vec(0))  # the first add's embedding, not the retry's


def test_update_delete_history(store: FactStore) -> None:
    record, _ = store.add("alice", NewFact(text="Alice lives in Paris."), _vec(0))
    updated = store.update(record.fact_id, "alice", "Alice lives in Lyon.", _vec(1))
    assert updated.version == 2 and store.get(record.fact_id).text == "Alice lives in Lyon."
    # the old text is free again: re-adding it makes a new fact, the updated one is untouched
    other, created = store.add("alice", NewFact(text="Alice lives in Paris."), _vec(2))
    assert created and other.fact_id != record.fact_id
    live_events = store.history(record.fact_id)
    assert live_events[1].old_text == "Alice lives in Paris." and live_events[1].new_text == "Alice lives in Lyon."
    store.delete(record.fact_id, "alice")
    with pytest.raises(UnknownFact):
        store.get(record.fact_id)
    assert [r.fact_id for r in store.get_all("alice")] == [other.fact_id]
    events = store.history(record.fact_id)
    assert [e.event for e in events] == ["ADD", "UPDATE", "DELETE"]
    assert [e.version for e in events] == [1, 2, 2]
    # delete erases: the events stay, their texts go, and so do the record's text and embedding
    assert all(e.old_text is None and e.new_text is None for e in events)
    raw = store.r.hgetall(store.keys.fact(record.fact_id))
    assert set(raw) == {b"user_id", b"version", b"deleted", b"updated_at"} and b"Lyon" not in b"".join(raw.values())
    with pytest.raises(UnknownFact):
        store.update(record.fact_id, "alice", "resurrected", _vec(3))


def test_users_are_isolated(store: FactStore) -> None:
    a, _ = store.add("alice", NewFact(text="Same text."), _vec(0))
    b, created = store.add("bob", NewFact(text="Same text."), _vec(0))
    assert created and a.fact_id != b.fact_id
    with pytest.raises(UnknownFact):
        store.get(a.fact_id, "bob")
    with pytest.raises(UnknownFact):
        store.delete(a.fact_id, "bob")
    with pytest.raises(UnknownFact):
        store.history(a.fact_id, "bob")
    assert store.delete_all("bob") == [b.fact_id]
    assert [r.fact_id for r in store.get_all("alice")] == [a.fact_id]
    assert store.user_of_fact(a.fact_id) == "alice" and store.user_of_fact("nope") is None


def test_window_and_shard_assignment(store: FactStore) -> None:
    turns = [Turn(turn_id=f"D1:{i}", speaker="A" if i % 2 else "B", text=f"turn {i}", order=i) for i in range(1, 9)]
    store.add_turns("alice", turns)
    assert [t.turn_id for t in store.window_before("alice", "D1:7", 5)] == ["D1:2", "D1:3", "D1:4", "D1:5", "D1:6"]
    assert [t.turn_id for t in store.window_before("alice", "D1:2", 5)] == ["D1:1"]
    assert store.window_before("alice", "D1:1", 5) == []
    assert store.window_before("alice", "unknown", 5) == []
    assert store.last_turn_order("alice") == 8 and store.last_turn_order("nobody") == -1
    shard = store.shard_of("alice", 4)
    assert store.shard_of("alice", 7) == shard  # assigned once, kept when the shard count changes
    assert "alice" in store.users_of_shard(shard)
    store.claim_user("zoe", 2)
    store.claim_user("zoe", 2)  # idempotent
    assert "zoe" in store.users_of_shard(2) and store.shard_of("zoe", 4) == 2
    with pytest.raises(ValueError, match="belongs to shard 2"):
        store.claim_user("zoe", 1)
