"""Arena tables: the numpy layouts of tables.bin and the lock that guards every change to them.

Layer 2 of the arena (kvarena.arena's docstring names all three). tables.bin holds, in order:

    entries     one record per entry: state, pins, generation, n_tokens, encode_start, tag
                (16 bytes the owner chooses, so that a restarted owner recognises what it
                may adopt), pages
    page_owner  int32 per page: the owning entry, -1 when free
    token_ids   int32 per token slot: the token each slot holds KV for
    page_device int32 per engine slot and page: that engine worker's HBM-tier slot, -1 when host only
    engine_pins int32 per engine slot and entry: the pins that engine's requests hold (their sum
                is the entry's `pins`), so an engine's successor clears its own pins only
    engine_owner int64 per engine slot: (pid, start time) of the process holding the slot, 0 when free

Engine slots: several engines may serve one arena (a shard's replicas, each with its own engine).
A replica claims a slot for its engine (kvarena.arena.FactArena.claim_engine_slot: its own again,
else the first whose holder's process is gone) and starts the engine with it
(connector.engine_config); the engine pins, unpins and publishes residency under it.

ArenaTables maps them (numpy views of one memmap), owns the `lock` file (fcntl) and a thread
lock, and has the record-level helpers the arena's operations share. No torch, no vLLM.

Erasure: freeing an entry zeroes its pages' token ids (and, in kvarena.arena, their KV bytes),
so a deleted fact's tokens and KV do not outlive it in the shared-memory files.

Entry states: FREE -> WRITING (allocated, capture in flight) -> LIVE (committed) ->
RETIRED (released while pinned) -> FREE.
"""

from __future__ import annotations

import fcntl
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from kvarena.geometry import ArenaError, ArenaGeometry

FREE, WRITING, LIVE, RETIRED = 0, 1, 2, 3
TAG_BYTES = 16
NO_TAG = np.void(bytes(TAG_BYTES))
STATE_NAMES = {FREE: "free", WRITING: "writing", LIVE: "live", RETIRED: "retired"}
MAX_ENGINES = 4  # engine slots of one arena: the most engines (replicas of one shard) that may serve it at once


def process_identity(pid: int) -> tuple[int, int]:
    """(pid, start time in clock ticks since boot) of a live process, else (pid, -1): the start time
    tells a process from a later one that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return pid, int(fields[19])  # field 22 of proc(5), counted after "pid (comm)"
    except (OSError, IndexError, ValueError):
        return pid, -1


@dataclass(frozen=True)
class EntryRef:
    """A handle on one arena entry: the id and the generation it was allocated with."""

    entry_id: int
    generation: int


@dataclass(frozen=True)
class EntryView:
    """What a reader needs to inject an entry (a snapshot taken under the lock)."""

    entry_id: int
    generation: int
    state: int
    n_tokens: int
    encode_start: int
    token_slots: np.ndarray  # [n_tokens] int64 indices into the kv tensor's token axis


@dataclass(frozen=True)
class PinnedEntries:
    """Entries pinned together (FactArena.pin_columns), column-wise: one row per placement asked
    for, in that order. A request injects 50+ entries; one object per entry costs more host time
    than the arrays (connector scheduler)."""

    entry_ids: np.ndarray  # [rows] int64
    generations: np.ndarray  # [rows] int64
    n_tokens: np.ndarray  # [rows] int64
    encode_starts: np.ndarray  # [rows] int64
    token_slots: np.ndarray  # [sum(n_tokens)] int64: every row's token slots, concatenated in row order


def entry_dtype(max_pages: int) -> np.dtype:
    """The numpy record type of one entry of the entry table."""
    return np.dtype(
        [
            ("state", np.int32),
            ("pins", np.int32),
            ("generation", np.int64),
            ("n_tokens", np.int32),
            ("encode_start", np.int32),
            ("n_pages", np.int32),
            ("tag", "V16"),  # the owner's name for what it holds, raw bytes (S16 would drop trailing NULs of a digest)
            ("pages", np.int32, (max_pages,)),
        ]
    )


def table_sizes(g: ArenaGeometry) -> list[int]:
    """Byte sizes of the tables in tables.bin: entries, page owners, token ids, page residency, engine pins."""
    return [
        g.max_entries * entry_dtype(g.max_pages_per_entry).itemsize,
        g.num_pages * 4,
        g.num_token_slots * 4,
        MAX_ENGINES * g.num_pages * 4,
        MAX_ENGINES * g.max_entries * 4,
        MAX_ENGINES * 2 * 8,
    ]


class ArenaTables:
    """The mapped tables of an arena directory (tables.bin) and its lock."""

    def __init__(self, path: Path, geometry: ArenaGeometry) -> None:
        self.path = Path(path)
        self.geometry = geometry
        g = geometry
        record_dtype = entry_dtype(g.max_pages_per_entry)
        sizes = table_sizes(g)
        found = (self.path / "tables.bin").stat().st_size
        if found != sum(sizes):  # written by another version: the owner rebuilds a derived arena
            raise ArenaError(f"arena tables at {self.path} hold {found} bytes, this version expects {sum(sizes)}")
        self._tables = np.memmap(self.path / "tables.bin", dtype=np.uint8, mode="r+", shape=(sum(sizes),))
        offset = 0
        self.entries = np.ndarray((g.max_entries,), dtype=record_dtype, buffer=self._tables, offset=offset)
        offset += sizes[0]
        self.page_owner = np.ndarray((g.num_pages,), dtype=np.int32, buffer=self._tables, offset=offset)
        offset += sizes[1]
        self.token_ids = np.ndarray((g.num_token_slots,), dtype=np.int32, buffer=self._tables, offset=offset)
        offset += sizes[2]
        # device slot of each page in each engine worker's HBM tier, -1 when host only
        self.page_device = np.ndarray((MAX_ENGINES, g.num_pages), dtype=np.int32, buffer=self._tables, offset=offset)
        offset += sizes[3]
        self.engine_pins = np.ndarray((MAX_ENGINES, g.max_entries), dtype=np.int32, buffer=self._tables, offset=offset)
        offset += sizes[4]
        self.engine_owner = np.ndarray((MAX_ENGINES, 2), dtype=np.int64, buffer=self._tables, offset=offset)
        self._lock_fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._thread_lock = threading.Lock()  # flock does not exclude threads sharing the fd

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    @contextmanager
    def locked(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # ------------------------------------------------------------------ record helpers
    @staticmethod
    def _engine(engine: int) -> int:
        if not 0 <= engine < MAX_ENGINES:
            raise ArenaError(f"engine slot {engine} is outside 0..{MAX_ENGINES - 1}")
        return engine

    def _record(self, ref: EntryRef):
        if not 0 <= ref.entry_id < self.geometry.max_entries:
            raise ArenaError(f"unknown entry {ref.entry_id}")
        record = self.entries[ref.entry_id]
        if int(record["generation"]) != ref.generation:
            raise ArenaError(f"entry {ref.entry_id} generation {ref.generation} is stale")
        return record

    def _free(self, entry_id: int) -> None:
        record = self.entries[entry_id]
        pages = record["pages"][: record["n_pages"]].copy()
        self._erase_pages(pages)  # a freed entry keeps no trace of what it held (erasure)
        self.page_owner[pages] = -1
        self.page_device[:, pages] = -1  # the workers' copies are stale now (they check generations)
        record["n_pages"] = 0
        record["n_tokens"] = 0
        record["tag"] = NO_TAG
        record["state"] = FREE

    def _erase_pages(self, pages: np.ndarray) -> None:
        """Zero the token ids of `pages` (FactArena zeroes their KV bytes too). Called under the
        lock as the pages are freed: on delete, on update, on eviction, on a user's delete."""
        self.token_ids[self._token_slots(pages, len(pages) * self.geometry.page_tokens)] = 0

    def _token_slots(self, pages: np.ndarray, n_tokens: int) -> np.ndarray:
        page_tokens = self.geometry.page_tokens
        slots = (pages.astype(np.int64)[:, None] * page_tokens + np.arange(page_tokens)).reshape(-1)
        return slots[:n_tokens]

    def _view(self, entry_id: int) -> EntryView:
        record = self.entries[entry_id]
        n_pages = int(record["n_pages"])
        n_tokens = int(record["n_tokens"])
        return EntryView(
            entry_id=entry_id,
            generation=int(record["generation"]),
            state=int(record["state"]),
            n_tokens=n_tokens,
            encode_start=int(record["encode_start"]),
            token_slots=self._token_slots(record["pages"][:n_pages].copy(), n_tokens),
        )

    # ------------------------------------------------------------------ engine slots
    def claim_engine_slot(self, pid: int) -> int:
        """The engine slot of the process `pid` (a replica about to start its engine): the one it
        holds already (an engine restarted in place), else the first slot that is free or whose
        holder's process is gone (a replica that died or gave its slot up). Raises ArenaError when
        MAX_ENGINES live processes hold slots. The engine clears the slot's old pins when it starts."""
        identity = process_identity(pid)
        if identity[1] < 0:
            raise ArenaError(f"no live process {pid} to hold an engine slot")
        with self.locked():
            holders = [tuple(int(v) for v in row) for row in self.engine_owner]
            if identity in holders:
                return holders.index(identity)
            for slot, holder in enumerate(holders):
                if not _alive(holder):
                    self.engine_owner[slot] = identity
                    return slot
        raise ArenaError(f"all {MAX_ENGINES} engine slots of the arena at {self.path} are held by live processes: {holders}")

    def release_engine_slot(self, slot: int, pid: int) -> None:
        """Process `pid` gives its slot up (its engine died and another replica will replace it)."""
        with self.locked():
            if tuple(int(v) for v in self.engine_owner[self._engine(slot)]) == process_identity(pid):
                self.engine_owner[slot] = 0

    def live_engines(self) -> int:
        """How many engine slots live processes hold."""
        return sum(1 for row in self.engine_owner if _alive(tuple(int(v) for v in row)))


def _alive(holder: tuple[int, int]) -> bool:
    """Whether the process that claimed an engine slot as `holder` (pid, start time) still runs."""
    return holder[0] > 0 and holder[1] >= 0 and process_identity(holder[0]) == holder
