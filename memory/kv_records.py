"""The records of the fact-KV life cycle (memory.kv_lifecycle): what the shard knows about one
fact's KV (FactKV), the capture jobs it hands out (EncodeJob) and how they end (EncodeOutcome),
and the arena tag naming what an entry encodes (entry_tag); StoredFact, a fact record with its KV's
state as the shard reports it. No Ray, no vLLM."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Collection

from pydantic import Field

from kvarena.arena import EntryRef
from kvarena.params import EntryPlacement, KVMemoryParams
from memory.records import FactRecord

PREFIX_KEY = "__prefix__"  # the instruction prefix's arena entry, next to the facts'


@dataclass
class FactKV:
    """What the shard knows about one fact's KV."""

    user_id: str
    version: int
    text: str
    segment_ids: tuple[int, ...]
    source_id: str | None = None
    ref: EntryRef | None = None  # live entry
    encoding: "EncodeJob | None" = None  # in-flight job
    attempts: int = 0  # failed encodes so far (engine deaths not counted)
    error: str | None = None  # why the last encode failed
    failed: bool = False  # gave up: served as text until the fact changes or the shard restarts
    neighbours: tuple[str, ...] = ()  # the facts its live or in-flight KV was encoded behind


EncodeOutcome = bool | str | None
"""How an encode job ended: True captured; False not captured; a string: failed, and why; None:
not run (the engine was unavailable), which does not count as an attempt."""


def entry_tag(key: str, version: int, neighbours: Collection[tuple[str, int]] = ()) -> bytes:
    """The arena tag of a fact's (or the prefix's) entry: 16 bytes naming key, version and the
    facts (id, version) it was encoded behind, so a restart adopts only KV encoded behind the
    neighbours the fact has now."""
    text = f"{key}:{version}" + "".join(f"|{n}:{v}" for n, v in neighbours)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class EncodeJob:
    """Capture prompt tokens [start, start + length) of `token_ids` into arena entry (entry, generation)."""

    job_id: str
    key: str  # fact id or PREFIX_KEY
    version: int
    entry: int
    generation: int
    token_ids: list[int]
    start: int
    length: int
    issued_at: float = 0.0
    cache_salt: str | None = None  # the fact owner's prefix-cache scope (its window is their text)
    engine_slot: int = 0  # the engine (of the shard's replicas) that took it

    def kv_transfer_params(self) -> dict[str, Any]:
        placement = EntryPlacement(entry=self.entry, generation=self.generation, start=self.start)
        return KVMemoryParams(capture=placement).to_kv_transfer_params()


class StoredFact(FactRecord):
    """A fact record with the state of its KV on the shard (what `GET /v1/memories/{id}` shows)."""

    kv: str = Field(
        "unknown", description="live | encoding | queued | failed (served as text, see kv_error) | evicted | unknown"
    )
    kv_error: str | None = Field(None, description="Why the fact's last encode failed.")
    kv_attempts: int = Field(0, description="Failed encodes of this version of the fact.")
