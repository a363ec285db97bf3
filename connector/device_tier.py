"""HBM tier bookkeeping of the GPU path (numpy only): which arena pages the device holds.

The HBM tier is a device tensor of `device_pages` arena pages ([num_layers, device_pages *
page_tokens, 2, kv_heads, head_size], allocated by connector.gpu_injector.GpuInjector).
DeviceTierMap is its page -> slot map, tagged with the owning entry and its generation (a
freed and reused page never hits a stale copy), with promotion on use and LRU demotion when
full (the host copy stays authoritative, so demotion is only forgetting). layer_groups splits
the layers into the groups whose host-tier copies overlap the forward.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


class DeviceTierMap:
    """Which arena page each HBM-tier slot holds, tagged (entry, generation); LRU eviction."""

    def __init__(self, capacity: int, num_pages: int) -> None:
        self.capacity = capacity
        self.page_slot = np.full(num_pages, -1, dtype=np.int64)
        self.slot_page = np.full(capacity, -1, dtype=np.int64)
        self.slot_tag = np.full((capacity, 2), -1, dtype=np.int64)
        self.last_use = np.zeros(capacity, dtype=np.int64)
        self.clock = 0

    def lookup(self, pages: np.ndarray, entries: np.ndarray, generations: np.ndarray) -> np.ndarray:
        """Slot of each page whose resident copy belongs to this entry generation, else -1; marks use."""
        self.clock += 1
        slots = self.page_slot[pages] if self.capacity else np.full(len(pages), -1, dtype=np.int64)
        found = np.flatnonzero(slots >= 0)
        if len(found):
            candidate = slots[found]
            stale = (self.slot_tag[candidate, 0] != entries[found]) | (self.slot_tag[candidate, 1] != generations[found])
            slots[found[stale]] = -1
            self.last_use[slots[slots >= 0]] = self.clock
        return slots

    def assign(
        self,
        pages: np.ndarray,
        entries: np.ndarray,
        generations: np.ndarray,
        protected: np.ndarray,
        evict: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Give slots to `pages` (unique, not validly resident). Returns (slots or -1, evicted pages).

        A page keeps its own stale slot; otherwise free slots go first, then (if `evict`) the
        least recently used slots outside `protected` (the slots this step reads)."""
        out = np.full(len(pages), -1, dtype=np.int64)
        if self.capacity == 0 or len(pages) == 0:
            return out, np.empty(0, dtype=np.int64)
        own = self.page_slot[pages]
        out[own >= 0] = own[own >= 0]
        need = np.flatnonzero(out < 0)
        taken = np.zeros(self.capacity, dtype=bool)
        taken[protected[protected >= 0]] = True
        taken[out[out >= 0]] = True
        free = np.flatnonzero((self.slot_page < 0) & ~taken)
        n_free = min(len(need), len(free))
        out[need[:n_free]] = free[:n_free]
        taken[free[:n_free]] = True
        rest = need[n_free:]
        if len(rest) and evict:
            candidates = np.flatnonzero(~taken)
            if len(candidates):
                k = min(len(rest), len(candidates))
                order = np.argpartition(self.last_use[candidates], k - 1)[:k] if k < len(candidates) else np.arange(len(candidates))
                victims = candidates[order][:k]
                out[rest[:k]] = victims
        chosen = np.flatnonzero(out >= 0)
        slots = out[chosen]
        previous = self.slot_page[slots]
        evicted = previous[(previous >= 0) & (previous != pages[chosen])]
        self.page_slot[evicted] = -1
        self.slot_page[slots] = pages[chosen]
        self.page_slot[pages[chosen]] = slots
        self.slot_tag[slots, 0] = entries[chosen]
        self.slot_tag[slots, 1] = generations[chosen]
        self.last_use[slots] = self.clock
        return out, evicted

    def drop_pages(self, pages: np.ndarray) -> np.ndarray:
        """Forget these pages where resident; returns those that were."""
        pages = np.asarray(pages, dtype=np.int64)
        resident = pages[self.page_slot[pages] >= 0] if self.capacity else np.empty(0, dtype=np.int64)
        slots = self.page_slot[resident]
        self.slot_page[slots] = -1
        self.slot_tag[slots] = -1
        self.page_slot[resident] = -1
        return resident

    def stale_slots(self, owner_of: "Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]") -> np.ndarray:
        """Held slots whose page now belongs to no entry, or to another entry generation (the
        entry was freed, and maybe the page reused): their bytes are a freed entry's. `owner_of`
        gives pages' current (entry, generation), as the arena says."""
        held = np.flatnonzero(self.slot_page >= 0)
        if not len(held):
            return held
        entries, generations = owner_of(self.slot_page[held])
        return held[(self.slot_tag[held, 0] != entries) | (self.slot_tag[held, 1] != generations)]

    def drop_all(self) -> np.ndarray:
        """Forget every resident page; returns the pages that were resident."""
        pages = self.slot_page[self.slot_page >= 0].copy()
        self.page_slot[pages] = -1
        self.slot_page[:] = -1
        self.slot_tag[:] = -1
        return pages

    def resident_pages(self) -> int:
        return int((self.slot_page >= 0).sum())


def layer_groups(num_layers: int, cap: int = 8) -> list[tuple[int, int]]:
    """[start, end) groups of sizes 1, 1, 2, 4, ... capped: small first so the forward starts early."""
    groups, start, size = [], 0, 1
    while start < num_layers:
        end = min(num_layers, start + size)
        groups.append((start, end))
        if len(groups) > 1:
            size = min(cap, size * 2)
        start = end
    return groups
