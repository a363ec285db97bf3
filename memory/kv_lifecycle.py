"""The fact-KV life cycle of one shard: encode queue, capture jobs in flight, LRU of live KV.

Layers, bottom up:
- the arena (kvarena.arena.FactArena) holds the bytes and the entry states;
- FactKV is what the shard knows about one fact's KV: its tokens, its live entry, its job;
- FactKVLifecycle moves facts through queued -> encoding (an EncodeJob holds a WRITING entry)
  -> live (committed, in the LRU) -> evicted or released, and back to queued on use.

Encoding needs the engine, which lives in the LLM replica, so jobs are handed out
(take_jobs) and reported back (complete_jobs) by whoever drives the engine. No Ray, no vLLM.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvarena.arena import FREE, ArenaError, ArenaFull, EntryRef, FactArena
from kvarena.params import EntryPlacement, KVMemoryParams
from memory.fact_store import FactRecord, Turn
from memory.prompting import PromptLayout

logger = logging.getLogger(__name__)

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

    def kv_transfer_params(self) -> dict[str, Any]:
        placement = EntryPlacement(entry=self.entry, generation=self.generation, start=self.start)
        return KVMemoryParams(capture=placement).to_kv_transfer_params()


WindowOf = Callable[[FactKV], list[Turn]]  # the turns a fact is encoded behind


class FactKVLifecycle:
    """Queue, jobs and LRU over one arena (see the module docstring). Not thread-safe: the shard
    calls it one method at a time."""

    def __init__(
        self,
        arena: FactArena,
        layout: PromptLayout,
        instruction: str,
        window_of: WindowOf,
        encode_timeout_s: float,
        name: str = "shard",
    ) -> None:
        self.arena = arena
        self.layout = layout
        self.window_of = window_of
        self.encode_timeout_s = encode_timeout_s
        self.name = name
        self.facts: dict[str, FactKV] = {}
        self.queue: deque[str] = deque()
        self.in_flight: dict[str, EncodeJob] = {}
        self.lru: OrderedDict[str, None] = OrderedDict()  # facts with live KV, least recently used first
        self.prefix = FactKV(user_id="", version=1, text=instruction, segment_ids=tuple(layout.prefix_ids))
        self.facts_encoded = 0

    # ------------------------------------------------------------------ start-up
    def reset_arena(self) -> None:
        """Release every entry a previous incarnation left (pinned ones retire until unpinned)."""
        entries = self.arena.entries
        for entry_id in np.flatnonzero(entries["state"] != FREE):
            ref = EntryRef(int(entry_id), int(entries[entry_id]["generation"]))
            try:
                self.arena.release(ref)
            except ArenaError:
                pass
        self.queue.append(PREFIX_KEY)

    # ------------------------------------------------------------------ facts in and out
    def track(self, record: FactRecord) -> None:
        """Know a fact (new, or a new version of one) and queue its encoding."""
        self.facts[record.fact_id] = FactKV(
            user_id=record.user_id,
            version=record.version,
            text=record.text,
            segment_ids=tuple(self.layout.fact_ids(record.text)),
            source_id=record.source_id,
        )
        self.queue.append(record.fact_id)

    def forget(self, fact_id: str) -> None:
        self.drop_kv(fact_id)
        self.facts.pop(fact_id, None)
        try:
            self.queue.remove(fact_id)
        except ValueError:
            pass

    def drop_kv(self, fact_id: str) -> None:
        """Release the fact's live entry. An entry still being captured is left to its job: the
        capture may still be writing, and complete_jobs releases it once the job no longer
        matches the fact (deleted, or re-tracked by an update)."""
        state = self.facts.get(fact_id)
        if state is not None and state.ref is not None:
            self.arena.release(state.ref)  # retires it if a request still pins it
            state.ref = None
            self.lru.pop(fact_id, None)

    def use(self, fact_id: str) -> FactKV:
        """A fact a request is about to use: fresh in the LRU, or queued again if its KV is gone."""
        state = self.facts[fact_id]
        if state.ref is not None:
            self.lru.move_to_end(fact_id)
        elif state.encoding is None and fact_id not in self.queue:
            self.queue.append(fact_id)  # evicted: re-encode on use
        return state

    # ------------------------------------------------------------------ encoding
    def take_jobs(self, max_jobs: int) -> list[EncodeJob]:
        """Allocate arena entries for queued facts and hand out their capture jobs."""
        self.expire_jobs()
        jobs: list[EncodeJob] = []
        while self.queue and len(jobs) < max_jobs:
            key = self.queue.popleft()
            state = self.prefix if key == PREFIX_KEY else self.facts.get(key)
            if state is None or state.ref is not None or state.encoding is not None:
                continue
            if key == PREFIX_KEY:
                tokens, start, length = list(self.prefix.segment_ids), 0, len(self.prefix.segment_ids)
            else:
                prompt = self.layout.encode_prompt(state.text, self.window_of(state))
                tokens, start, length = prompt.token_ids, prompt.start, prompt.length
            try:
                ref = self._allocate(tokens[start : start + length], start)
            except ArenaFull as exc:
                logger.warning("%s: %s; %s stays prefilled as text", self.name, exc, key)
                self.queue.appendleft(key)
                break
            job = EncodeJob(f"{key}:{state.version}:{ref.entry_id}:{ref.generation}", key, state.version, ref.entry_id,
                            ref.generation, tokens, start, length, time.time())
            state.encoding = job
            self.in_flight[job.job_id] = job
            jobs.append(job)
        return jobs

    def complete_jobs(self, outcomes: dict[str, bool]) -> int:
        """Commit the captured entries (job id -> captured); returns how many facts went live."""
        live = 0
        for job_id, captured in outcomes.items():
            job = self.in_flight.pop(job_id, None)
            if job is None:
                continue
            ref = EntryRef(job.entry, job.generation)
            state = self._state_of_job(job)
            if state is None or not captured:
                self.arena.release(ref)
                if state is not None:
                    state.encoding = None
                    self.queue.append(job.key)  # not captured (engine refused): retry
                continue
            try:
                self.arena.commit(ref)
            except ArenaError as exc:  # released or reset underneath the capture: encode again
                logger.warning("%s: %s not committed (%s); retrying", self.name, job_id, exc)
                state.encoding = None
                self.queue.append(job.key)
                continue
            state.ref, state.encoding = ref, None
            if job.key != PREFIX_KEY:
                self.lru[job.key] = None
                self.facts_encoded += 1
            live += 1
        return live

    def pending(self) -> int:
        return len(self.queue) + len(self.in_flight)

    def _state_of_job(self, job: EncodeJob) -> FactKV | None:
        """The state the job is still encoding for; None once its fact was deleted or updated."""
        state = self.prefix if job.key == PREFIX_KEY else self.facts.get(job.key)
        if state is None or state.encoding is None or state.encoding.job_id != job.job_id:
            return None
        return state

    def expire_jobs(self) -> None:
        """Jobs never reported back (a replica died mid-encode) are released and retried."""
        deadline = time.time() - self.encode_timeout_s
        for job_id, job in list(self.in_flight.items()):
            if job.issued_at < deadline:
                logger.warning("%s: encode job %s timed out; retrying", self.name, job_id)
                self.complete_jobs({job_id: False})

    def _allocate(self, token_ids: list[int], encode_start: int) -> EntryRef:
        """Allocate an entry, evicting the least recently used facts' KV when the arena is full."""
        while True:
            try:
                return self.arena.allocate(token_ids, encode_start)
            except ArenaFull:
                if not self.lru:
                    raise
                victim, _ = self.lru.popitem(last=False)
                state = self.facts[victim]
                assert state.ref is not None
                self.arena.release(state.ref)
                state.ref = None  # prefilled as text until used again
