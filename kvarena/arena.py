"""FactArena: the fact KV store, in shared memory, addressed by entry ids.

One arena holds the KV of many memory entries (facts, instruction prefixes, whole memories)
for one model. It lives in a directory (normally under /dev/shm) so that three kinds of
process reach the same bytes:

- the owner (a memory shard, or a test) allocates entries, commits and releases them;
- the engine core's scheduler (connector, scheduler role) pins the entries a request
  will inject and unpins them when the request finishes;
- the engine's worker (connector, worker role) writes captured KV into entry pages and
  reads them at injection.

Layout of the directory:
    header.json  geometry (layers, kv heads, head size, dtype, page size, capacities)
    kv.bin       KV data, a torch tensor [num_layers, num_pages * page_tokens, 2, kv_heads, head_size]
    tables.bin   entry table, page ownership, token ids, page residency (numpy views)
    lock         fcntl lock file: every state change of the tables happens under it

Keys are stored as the engine wrote them (rotated for the positions they were encoded at,
`encode_start` onwards); the injector re-rotates them by the position difference.

Tiers: kv.bin is the host tier and stays authoritative. On a GPU, the engine's worker pins it
(cudaHostRegister) and keeps some pages in an HBM tier of its own; it publishes which pages
are resident in `page_device` (per engine slot, one int32 per page: the device slot, -1 when host
only), so the owner can account bytes per tier (usage()). Only the workers write that table,
except that freeing a page resets it.

Layers (one module each, every one importable without vLLM):
    kvarena.geometry  ArenaGeometry (header.json), arena_geometry_for, ArenaError, ArenaFull
    kvarena.tables    tables.bin's numpy layouts (entry table, page owners, token ids, page
                      residency), EntryRef / EntryView, entry states, the lock (ArenaTables)
    kvarena.arena     FactArena: the allocator, pin/unpin, commit/release and the KV pages
                      tensor (kv.bin; torch is imported when an arena is opened)
The names of the lower layers are re-exported here.

Entry life cycle: FREE -> WRITING (allocated, capture in flight) -> LIVE (committed) ->
RETIRED (released by the owner while a request still pins it) -> FREE. A pinned entry is
never freed: release() of a pinned entry only retires it, and the last unpin frees it. Pins
live in shared memory and outlive a crashed engine. Several engines may serve one arena (the
replicas of one shard), each under its own engine slot (kvarena.tables.MAX_ENGINES): an engine
pins and unpins under its slot, and its successor in that slot clears that slot's pins
(clear_pins(engine)) when it starts, leaving the other engines' pins alone. Entries outlive a crashed owner too: each carries the owner's
tag, and a restarted owner adopts the LIVE ones it recognises (live_entries) and releases
the rest.

Erasure: when an entry is freed (released, last unpin of a retired entry, pins cleared) its pages'
token ids and KV bytes are zeroed in tables.bin and kv.bin under the lock, so the bytes of a
deleted or replaced fact are gone from the host tier at once. The GPU worker's HBM copy of those
pages is tagged with the old generation, never read again, and zeroed at the worker's next step
(connector.gpu_injector.GpuInjector.erase_freed_pages).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvarena.geometry import ArenaError, ArenaFull, ArenaGeometry, arena_geometry_for
from kvarena.tables import (
    FREE, LIVE, MAX_ENGINES, RETIRED, STATE_NAMES, TAG_BYTES, WRITING, ArenaTables, EntryRef, EntryView, PinnedEntries,
    entry_dtype, table_sizes,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "FREE", "WRITING", "LIVE", "RETIRED", "STATE_NAMES", "MAX_ENGINES",
    "ArenaError", "ArenaFull", "ArenaGeometry", "arena_geometry_for",
    "ArenaTables", "EntryRef", "EntryView", "entry_dtype", "table_sizes",
    "FactArena",
]  # fmt: skip


class FactArena(ArenaTables):
    """Shared-memory fact KV arena (see the module docstring). Open with create() or open()."""

    def __init__(self, path: Path, geometry: ArenaGeometry) -> None:
        import torch  # torch: not in the builder or ingress

        super().__init__(path, geometry)
        g = geometry
        numel = g.num_layers * g.num_token_slots * 2 * g.num_kv_heads * g.head_size
        flat = torch.from_file(str(self.path / "kv.bin"), shared=True, size=numel, dtype=g.torch_dtype)
        self.kv = flat.view(g.num_layers, g.num_token_slots, 2, g.num_kv_heads, g.head_size)
        self._kv_bytes = self.kv.view(torch.uint8).numpy()  # the same bytes, for erasure (_erase_pages)

    # ------------------------------------------------------------------ opening
    @classmethod
    def create(cls, path: Path | str, geometry: ArenaGeometry, exist_ok: bool = False) -> "FactArena":
        path = Path(path)
        if (path / "header.json").exists():
            if not exist_ok:
                raise ArenaError(f"an arena already exists at {path}")
            arena = cls.open(path)
            if arena.geometry != geometry:
                raise ArenaError(f"arena at {path} has geometry {arena.geometry}, wanted {geometry}")
            return arena
        path.mkdir(parents=True, exist_ok=True)
        with open(path / "tables.bin", "wb") as f:
            f.truncate(sum(table_sizes(geometry)))
        with open(path / "kv.bin", "wb") as f:
            f.truncate(geometry.kv_bytes())  # sparse: pages cost memory when first written
        arena = cls(path, geometry)
        arena.page_owner[:] = -1
        arena.page_device[:] = -1
        arena._tables.flush()
        (path / "header.json.tmp").write_text(json.dumps(asdict(geometry)))
        os.replace(path / "header.json.tmp", path / "header.json")  # the arena exists once this lands
        return arena

    @classmethod
    def open(cls, path: Path | str) -> "FactArena":
        path = Path(path)
        try:
            geometry = ArenaGeometry(**json.loads((path / "header.json").read_text()))
        except FileNotFoundError as exc:
            raise ArenaError(f"no fact arena at {path}") from exc
        return cls(path, geometry)

    # ------------------------------------------------------------------ owner side
    def allocate(self, token_ids: list[int] | np.ndarray, encode_start: int, tag: bytes = b"") -> EntryRef:
        """Reserve an entry and its pages for `token_ids` encoded from position `encode_start`.
        `tag` (at most 16 bytes, stored padded with zero bytes to 16) names what the entry holds,
        for a restarted owner (live_entries)."""
        if len(tag) > TAG_BYTES:
            raise ArenaError(f"an entry tag holds at most {TAG_BYTES} bytes, got {len(tag)}")
        g = self.geometry
        n = len(token_ids)
        if n <= 0:
            raise ArenaError("an entry needs at least one token")
        n_pages = -(-n // g.page_tokens)
        if n_pages > g.max_pages_per_entry:
            raise ArenaError(f"entry of {n} tokens exceeds the {g.max_entry_tokens}-token entry limit")
        with self.locked():
            free_entries = np.flatnonzero(self.entries["state"] == FREE)
            free_pages = np.flatnonzero(self.page_owner < 0)
            if len(free_entries) == 0 or len(free_pages) < n_pages:
                raise ArenaFull(
                    f"arena full: {len(free_entries)} free entries, {len(free_pages)} free pages, {n_pages} needed"
                )
            entry_id = int(free_entries[0])
            pages = free_pages[:n_pages].astype(np.int32)
            record = self.entries[entry_id]
            record["generation"] += 1
            record["n_tokens"] = n
            record["encode_start"] = encode_start
            record["n_pages"] = n_pages
            record["pages"][:n_pages] = pages
            record["pins"] = 0
            self.engine_pins[:, entry_id] = 0
            record["tag"] = np.void(tag.ljust(TAG_BYTES, b"\0"))
            self.page_owner[pages] = entry_id
            self.token_ids[self._token_slots(pages, n)] = np.asarray(token_ids, dtype=np.int32)
            record["state"] = WRITING
            return EntryRef(entry_id, int(record["generation"]))

    def commit(self, ref: EntryRef) -> None:
        """WRITING -> LIVE: the capture finished and the entry may be injected."""
        with self.locked():
            record = self._record(ref)
            if record["state"] != WRITING:
                raise ArenaError(f"entry {ref} is {STATE_NAMES[int(record['state'])]}, not writing")
            record["state"] = LIVE

    def release(self, ref: EntryRef) -> bool:
        """Free an entry; returns True when freed now, False when retired until unpinned."""
        with self.locked():
            record = self._record(ref)
            if record["state"] in (FREE, RETIRED):
                return False
            if record["pins"] > 0:
                record["state"] = RETIRED
                return False
            self._free(ref.entry_id)
            return True

    def _erase_pages(self, pages: np.ndarray) -> None:
        """Zero the token ids and the KV bytes (every layer, K and V) of pages being freed. A run of
        consecutive pages is one slice per layer, zeroed through a numpy view: a memset per layer on
        this thread (torch's index_fill_ or zero_ go through its thread pool, ms per entry when the
        host is busy)."""
        super()._erase_pages(pages)
        if not len(pages):
            return
        pt = self.geometry.page_tokens
        ordered = np.sort(pages.astype(np.int64))
        breaks = np.flatnonzero(np.diff(ordered) != 1) + 1
        for run in np.split(ordered, breaks):
            self._kv_bytes[:, int(run[0]) * pt : (int(run[-1]) + 1) * pt] = 0

    def live_entries(self) -> list[tuple[EntryRef, bytes, np.ndarray]]:
        """(ref, tag (its 16 stored bytes), token ids) of every LIVE entry: what a restarted owner
        may adopt instead of encoding it again."""
        with self.locked():
            ids = np.flatnonzero(self.entries["state"] == LIVE)
            views = [self._view(int(e)) for e in ids]
            tags = self.entries["tag"][ids]
            return [
                (EntryRef(v.entry_id, v.generation), bytes(tag), self.token_ids[v.token_slots].copy())
                for v, tag in zip(views, tags)
            ]

    def is_pinned(self, ref: EntryRef) -> bool:
        """Whether a request holds the entry (releasing it now would only retire it)."""
        record = self.entries[ref.entry_id]
        return int(record["generation"]) == ref.generation and int(record["pins"]) > 0

    # ------------------------------------------------------------------ scheduler side
    def clear_pins(self, engine: int | None = None) -> int:
        """Drop the pins of engine slot `engine` (every slot's when None) and free the retired
        entries no pin holds any more; returns how many pins were dropped.

        Only engine schedulers pin: when an engine's scheduler starts, every pin left in its slot
        belongs to requests of the engine that held the slot before and died, which will never
        unpin. Other slots' pins belong to live engines serving the same arena."""
        with self.locked():
            slots = slice(None) if engine is None else self._engine(engine)
            dropped = self.engine_pins[slots].copy()
            held = int(dropped.sum())
            self.engine_pins[slots] = 0
            totals = self.entries["pins"]
            totals -= dropped.sum(axis=0) if dropped.ndim == 2 else dropped
            for entry_id in np.flatnonzero((self.entries["state"] == RETIRED) & (totals <= 0)):
                totals[entry_id] = 0
                self._free(int(entry_id))
            return held

    def pin(self, entry_id: int, generation: int, engine: int = 0) -> EntryView | None:
        """Pin a LIVE entry of this generation for engine slot `engine`; None when it is unknown,
        stale or not live."""
        with self.locked():
            if not 0 <= entry_id < self.geometry.max_entries:
                return None
            record = self.entries[entry_id]
            if record["state"] != LIVE or int(record["generation"]) != generation:
                return None
            record["pins"] += 1
            self.engine_pins[self._engine(engine), entry_id] += 1
            return self._view(entry_id)

    def pin_many(self, placements: list[tuple[int, int]], engine: int = 0) -> list[EntryView | None]:
        """Pin several (entry, generation) pairs under one lock: all or none. One view per pair;
        where any pair cannot be pinned, nothing stays pinned and the failing pairs are None."""
        if not placements:
            return []
        ids = np.fromiter((e for e, _ in placements), dtype=np.int64, count=len(placements))
        gens = np.fromiter((g for _, g in placements), dtype=np.int64, count=len(placements))
        pinned, ok = self.pin_columns(ids, gens, engine)
        if pinned is None:
            with self.locked():
                return [None if not good else self._view(int(e)) for e, good in zip(ids, ok)]
        ends = np.cumsum(pinned.n_tokens)
        return [
            EntryView(entry_id=e, generation=g, state=LIVE, n_tokens=n, encode_start=es, token_slots=pinned.token_slots[end - n : end])
            for e, g, n, es, end in zip(
                ids.tolist(), gens.tolist(), pinned.n_tokens.tolist(), pinned.encode_starts.tolist(), ends.tolist()
            )
        ]

    def pin_columns(
        self, entry_ids: np.ndarray, generations: np.ndarray, engine: int = 0
    ) -> tuple[PinnedEntries | None, np.ndarray]:
        """Pin the LIVE entries (entry_ids[i], generations[i]) for engine slot `engine` under one lock, all or none:
        (PinnedEntries in the order asked, all-True mask), or (None, mask of the pinnable ones)
        with nothing pinned. The same entry may be asked for twice (pinned twice). Column-wise
        numpy: no per-record access of the structured table."""
        ids = np.asarray(entry_ids, dtype=np.int64)
        gens = np.asarray(generations, dtype=np.int64)
        known = (ids >= 0) & (ids < self.geometry.max_entries)
        safe = np.where(known, ids, 0)
        with self.locked():
            ok = known & (self.entries["state"][safe] == LIVE) & (self.entries["generation"][safe] == gens)
            if not ok.all():
                return None, ok
            np.add.at(self.entries["pins"], ids, 1)
            np.add.at(self.engine_pins[self._engine(engine)], ids, 1)
            rows = self.entries[ids]  # a copy: the columns are a snapshot taken under the lock
        page_tokens = self.geometry.page_tokens
        n_tokens = rows["n_tokens"].astype(np.int64)
        used = int(rows["n_pages"].max()) if len(ids) else 0  # facts fill a page or two of max_pages_per_entry (64)
        slots = rows["pages"][:, :used].astype(np.int64)[:, :, None] * page_tokens + np.arange(page_tokens)
        slots = slots.reshape(len(ids), -1)
        token_slots = slots[np.arange(slots.shape[1]) < n_tokens[:, None]]  # row-major: each row's first n_tokens
        return PinnedEntries(ids, gens, n_tokens, rows["encode_start"].astype(np.int64), token_slots), ok

    def unpin(self, entry_id: int, generation: int, engine: int = 0) -> None:
        self.unpin_many([(entry_id, generation)], engine)

    def unpin_many(self, placements: list[tuple[int, int]], engine: int = 0) -> None:
        if placements:
            ids = np.fromiter((e for e, _ in placements), dtype=np.int64, count=len(placements))
            self.unpin_columns(ids, np.fromiter((g for _, g in placements), dtype=np.int64, count=len(placements)), engine)

    def unpin_columns(self, entry_ids: np.ndarray, generations: np.ndarray, engine: int = 0) -> None:
        """Undo pin_columns of engine slot `engine` (one unpin per row); the last unpin of a
        RETIRED entry (over every engine) frees it."""
        ids = np.asarray(entry_ids, dtype=np.int64)
        gens = np.asarray(generations, dtype=np.int64)
        if not len(ids):
            return
        with self.locked():
            pins = self.entries["pins"]
            own = self.engine_pins[self._engine(engine)]
            wanted = np.bincount(ids, minlength=len(pins))[ids]
            bad = (self.entries["generation"][ids] != gens) | (own[ids] < wanted)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ArenaError(f"unpin of entry {ids[i]} gen {gens[i]} that engine {engine} has not pinned")
            np.subtract.at(pins, ids, 1)
            np.subtract.at(own, ids, 1)
            for entry_id in np.unique(ids[(pins[ids] == 0) & (self.entries["state"][ids] == RETIRED)]):
                self._free(int(entry_id))

    def writing_view(self, entry_id: int, generation: int) -> EntryView | None:
        """The view of an entry being written (capture target); None when stale."""
        with self.locked():
            if not 0 <= entry_id < self.geometry.max_entries:
                return None
            record = self.entries[entry_id]
            if record["state"] != WRITING or int(record["generation"]) != generation:
                return None
            return self._view(entry_id)

    # ------------------------------------------------------------------ reading
    def entry_token_ids(self, view: EntryView) -> np.ndarray:
        return self.token_ids[view.token_slots].copy()

    def entry_kv(self, view: EntryView) -> "torch.Tensor":
        """[num_layers, n_tokens, 2, kv_heads, head_size] copy of an entry's KV."""
        import torch  # torch: not in the builder or ingress

        return self.kv.index_select(1, torch.from_numpy(view.token_slots))

    def state_of(self, ref: EntryRef) -> str:
        record = self.entries[ref.entry_id]
        if int(record["generation"]) != ref.generation:
            return "stale"
        return STATE_NAMES[int(record["state"])]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers (K and V)."""
        return self.geometry.kv_bytes() // self.geometry.num_pages

    def usage(self) -> dict[str, int]:
        states = self.entries["state"]
        pages_used = int((self.page_owner >= 0).sum())
        resident = int(((self.page_device >= 0) & (self.page_owner >= 0)).sum())  # summed over the engines' HBM tiers
        return {
            "entries_live": int((states == LIVE).sum()),
            "entries_writing": int((states == WRITING).sum()),
            "entries_retired": int((states == RETIRED).sum()),
            "pins": int(self.entries["pins"].sum()),  # held by requests in the engine now
            "pages_used": pages_used,
            "pages_total": self.geometry.num_pages,
            "device_pages_resident": resident,  # also held in an engine worker's HBM tier (counted per engine)
            "bytes_host": pages_used * self.page_bytes,  # the host tier holds every used page
            "bytes_device": resident * self.page_bytes,
        }

    def publish_residency(self, pages: np.ndarray, slots: np.ndarray, engine: int = 0) -> None:
        """Worker side: record the device slots (-1: host only) of `pages` in engine slot `engine`'s HBM tier."""
        if len(pages):
            with self.locked():
                self.page_device[self._engine(engine), pages] = slots

    def forget_residency(self, engine: int) -> None:
        """Worker side, at start: no page is resident in engine slot `engine`'s HBM tier (a previous
        engine's tier died with it)."""
        with self.locked():
            self.page_device[self._engine(engine)] = -1

