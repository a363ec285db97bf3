"""Read repair: a shard takes Redis's word for a user after one of the user's writes failed.

A write's Redis call can fail after Redis applied it (Redis died before answering). The caller
got an error, so nothing was acknowledged, yet Redis, the source of truth, now holds a record the
shard does not index (an add), a version it does not serve (an update), or lacks a fact the shard
still retrieves (a delete). The shard marks the user unsure when a write raises; before the user's
call that reads or writes their memory through Redis anyway, and on the encode driver's poll
(every 0.5 s, so a user who never comes back is repaired too, and chats see the repair within
that), it re-reads the user's records and makes its view Redis's (ReadRepair.resync_user). The
chat path itself never waits for Redis: while Redis cannot answer, the user stays unsure, chats
are planned from what the shard has, and the poll tries again at most every RETRY_S seconds.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator, Mapping, Protocol

import numpy as np

from memory.fact_store import FactStore
from memory.kv_lifecycle import FactKV
from memory.records import FactRecord

logger = logging.getLogger(__name__)

RETRY_S = 5.0  # the poll's pause after a resync failed (Redis away): the shard's other calls go on


class RepairedShard(Protocol):
    """What read repair needs of a shard (memory.shard.MemoryShard is one): its records' store,
    the facts it tracks, and its two ways of changing them."""

    shard_id: int
    store: FactStore
    facts: Mapping[str, FactKV]

    def track_version(self, record: FactRecord, vector: np.ndarray) -> None: ...

    def forget(self, fact_id: str) -> None: ...


class ReadRepair:
    """The unsure users of one shard and their repair (module docstring)."""

    def __init__(self, shard: RepairedShard) -> None:
        self.shard = shard
        self.unsure: set[str] = set()
        self.resynced = 0  # users resynced since the shard started
        self.poll_after = 0.0  # monotonic time before which the poll does not try again (a resync failed)

    @contextlib.contextmanager
    def writing(self, user_id: str) -> Iterator[None]:
        """Around a write of the user's records: if it raises, Redis may have applied it anyway."""
        try:
            yield
        except Exception:
            self.unsure.add(user_id)
            raise

    def repair(self, user_id: str | None = None) -> None:
        """Resync the user when a write of theirs failed; None (the encode driver's poll): every
        unsure user, unless a resync failed less than RETRY_S ago."""
        if user_id is None and time.monotonic() < self.poll_after:
            return
        for user in [user_id] if user_id is not None else list(self.unsure):
            if user not in self.unsure:
                continue
            try:
                changed = self.resync_user(user)
            except Exception as exc:  # noqa: BLE001 - Redis still away: the next call tries again
                logger.warning("shard %d: user %s stays unsure: %s", self.shard.shard_id, user, exc)
                self.poll_after = time.monotonic() + RETRY_S
                continue
            self.unsure.discard(user)
            self.resynced += 1
            if changed:
                logger.warning("shard %d: resynced user %s from Redis: %s", self.shard.shard_id, user, changed)

    def resync_user(self, user_id: str) -> dict[str, int]:
        """Make the shard's view of the user's facts Redis's: records it lacks are indexed (with
        their stored embeddings) and queued for KV, newer versions replace older ones, facts Redis
        no longer holds are forgotten. Returns how many of each (non-zero counts only)."""
        shard = self.shard
        stored = {record.fact_id: (record, vector) for record, vector in shard.store.all_with_embeddings(user_id)}
        gone = [fact_id for fact_id, state in shard.facts.items() if state.user_id == user_id and fact_id not in stored]
        for fact_id in gone:
            shard.forget(fact_id)
        adopted = renewed = 0
        for fact_id, (record, vector) in stored.items():
            state = shard.facts.get(fact_id)
            if state is not None and state.version == record.version:
                continue
            shard.track_version(record, vector)  # an update Redis applied: the old KV is never injected again
            adopted, renewed = adopted + (state is None), renewed + (state is not None)
        counts = {"adopted": adopted, "renewed": renewed, "forgotten": len(gone)}
        return {name: n for name, n in counts.items() if n}
