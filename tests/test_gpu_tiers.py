"""HBM-tier bookkeeping of the GPU path (no GPU, no engine); the arena's residency table is
tested with the arena (tests/test_fact_arena.py)."""

from __future__ import annotations

import numpy as np

from connector.device_tier import DeviceTierMap, layer_groups


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
