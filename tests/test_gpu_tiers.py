"""Arena residency table and the HBM-tier bookkeeping of the GPU path (no GPU, no engine)."""

from __future__ import annotations

import numpy as np
import pytest

from connector.fact_arena import ArenaGeometry, FactArena
from connector.gpu_tiers import DeviceTierMap, layer_groups

GEOMETRY = ArenaGeometry(num_layers=2, num_kv_heads=2, head_size=32, dtype="float32", page_tokens=8, num_pages=16, max_entries=8, max_pages_per_entry=4)


@pytest.fixture()
def arena(tmp_path):
    a = FactArena.create(tmp_path / "arena", GEOMETRY)
    yield a
    a.close()


def test_usage_reports_bytes_per_tier(arena: FactArena) -> None:
    ref = arena.allocate(list(range(20)), 0)  # 3 pages
    arena.commit(ref)
    view = arena.pin(ref.entry_id, ref.generation)
    pages = np.unique(view.token_slots // GEOMETRY.page_tokens)
    usage = arena.usage()
    assert usage["pages_used"] == 3 and usage["device_pages_resident"] == 0 and usage["bytes_device"] == 0
    assert usage["bytes_host"] == 3 * arena.page_bytes == 3 * GEOMETRY.kv_bytes() // GEOMETRY.num_pages
    arena.publish_residency(pages[:2], np.array([5, 9]))
    assert arena.usage()["device_pages_resident"] == 2 and arena.usage()["bytes_device"] == 2 * arena.page_bytes
    other = FactArena.open(arena.path)  # the owner sees what the worker published
    assert other.usage()["device_pages_resident"] == 2
    arena.unpin(ref.entry_id, ref.generation)
    arena.release(ref)  # freeing pages forgets their residency
    assert other.usage()["device_pages_resident"] == 0 and (other.page_device[pages] == -1).all()
    other.close()


def test_arena_without_residency_table_is_extended(tmp_path) -> None:
    arena = FactArena.create(tmp_path / "old", GEOMETRY)
    ref = arena.allocate([1, 2, 3], 0)
    arena.close()
    tables = tmp_path / "old" / "tables.bin"
    size = tables.stat().st_size
    with open(tables, "r+b") as f:  # an arena written before the table existed
        f.truncate(size - GEOMETRY.num_pages * 4)
    reopened = FactArena.open(tmp_path / "old")
    assert (reopened.page_device == -1).all() and reopened.state_of(ref) == "writing"
    reopened.close()


def test_pin_many_is_all_or_nothing(arena: FactArena) -> None:
    a, b = arena.allocate([1, 2], 0), arena.allocate([3, 4], 0)
    arena.commit(a)
    arena.commit(b)
    views = arena.pin_many([(a.entry_id, a.generation), (b.entry_id, b.generation + 1)])
    assert views[0] is not None and views[1] is None
    assert arena.entries[a.entry_id]["pins"] == 0  # nothing stays pinned
    views = arena.pin_many([(a.entry_id, a.generation), (b.entry_id, b.generation)])
    assert all(v is not None for v in views)
    arena.unpin_many([(a.entry_id, a.generation), (b.entry_id, b.generation)])
    assert arena.entries[a.entry_id]["pins"] == 0 and arena.entries[b.entry_id]["pins"] == 0


def test_tier_map_tags_promotion_and_lru() -> None:
    tier = DeviceTierMap(capacity=3, num_pages=10)
    pages = np.array([1, 2, 3])
    entries, gens = np.array([0, 0, 1]), np.array([1, 1, 4])
    assert (tier.lookup(pages, entries, gens) == -1).all()
    slots, evicted = tier.assign(pages, entries, gens, protected=np.empty(0, dtype=np.int64))
    assert sorted(slots.tolist()) == [0, 1, 2] and len(evicted) == 0
    assert (tier.lookup(pages, entries, gens) == slots).all()
    # a reused page (new owner generation) never hits its stale copy, and keeps its own slot
    assert tier.lookup(np.array([3]), np.array([1]), np.array([5]))[0] == -1
    again, evicted = tier.assign(np.array([3]), np.array([1]), np.array([5]), protected=np.empty(0, dtype=np.int64))
    assert again[0] == slots[2] and len(evicted) == 0
    # full: the least recently used unprotected slot goes
    tier.lookup(np.array([1]), np.array([0]), np.array([1]))  # page 1 used last
    new, evicted = tier.assign(np.array([7]), np.array([2]), np.array([1]), protected=np.array([slots[2]]))
    assert evicted.tolist() == [2] and new[0] == slots[1]
    assert tier.page_slot[2] == -1 and tier.page_slot[7] == slots[1]
    # no eviction allowed: no slot
    none, _ = tier.assign(np.array([8]), np.array([3]), np.array([1]), protected=np.empty(0, dtype=np.int64), evict=False)
    assert none[0] == -1
    assert tier.drop_pages(np.array([3, 4])).tolist() == [3] and tier.page_slot[3] == -1
    assert sorted(tier.drop_all().tolist()) == [1, 7] and tier.resident_pages() == 0


def test_tier_map_with_no_capacity() -> None:
    tier = DeviceTierMap(capacity=0, num_pages=4)
    assert (tier.lookup(np.array([0, 1]), np.array([0, 0]), np.array([1, 1])) == -1).all()
    slots, evicted = tier.assign(np.array([0]), np.array([0]), np.array([1]), protected=np.empty(0, dtype=np.int64))
    assert slots[0] == -1 and len(evicted) == 0


def test_layer_groups_cover_every_layer_once_small_first() -> None:
    for n in (1, 2, 5, 30, 32):
        groups = layer_groups(n)
        covered = [layer for start, end in groups for layer in range(start, end)]
        assert covered == list(range(n))
        sizes = [end - start for start, end in groups]
        assert sizes[0] == 1 and max(sizes) <= 8
    assert [e - s for s, e in layer_groups(32)] == [1, 1, 2, 4, 8, 8, 8]
