"""The fact-KV life cycle of one shard: encode queue, capture jobs in flight, LRU of live KV.

Layers, bottom up:
- the arena (kvarena.arena.FactArena) holds the bytes and the entry states;
- FactKV is what the shard knows about one fact's KV: its tokens, its live entry, its job;
- FactKVLifecycle moves facts through queued -> encoding (an EncodeJob holds a WRITING entry)
  -> live (committed, in the LRU) -> evicted or released, and back to queued on use.

Fairness (memory.fairness): the queue serves users round robin, and the LRU keeps each user's
`arena_floor` entries from other users' facts.

Encoding needs the engine, which lives in the LLM replica, so jobs are handed out
(take_jobs) and reported back (complete_jobs) by whoever drives the engine. No Ray, no vLLM.

Failure: an encode that fails is retried at most `max_attempts` times (an engine that died
does not count); then the fact stays without KV, served as text, and its `error` says why.
A prompt that cannot fit the context or a fact too long for an arena entry fails at once.

Restart: every entry is tagged with a digest of (fact id, version); a new incarnation adopts
the LIVE entries whose tag and tokens match a fact it tracks (adopt_arena), releases the rest,
and queues only the facts left without KV, so a restart does not re-encode the whole shard.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Collection, Mapping

import numpy as np

from kvarena.arena import WRITING, ArenaError, ArenaFull, EntryRef, FactArena
from memory.fairness import FairQueue, FloorLRU
from memory.kv_records import PREFIX_KEY, EncodeJob, EncodeOutcome, FactKV, entry_tag
from memory.records import FactRecord, Turn
from memory.prompting import PromptLayout

logger = logging.getLogger(__name__)

WindowOf = Callable[[FactKV], list[Turn]]  # the conversation turns a fact is encoded behind
NeighboursOf = Callable[[str, FactKV], list[tuple[str, str]]]  # the facts (id, text) it is encoded behind


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
        context_tokens: int | None = None,
        max_attempts: int = 3,
        salt_of: Callable[[str], str] | None = None,
        neighbours_of: NeighboursOf | None = None,
        on_live: Callable[[str, FactKV], None] | None = None,
        arena_floor: int = 0,
    ) -> None:
        self.arena = arena
        self.salt_of = salt_of  # user id -> prefix-cache salt of that user's encodes
        self.layout = layout
        self.window_of = window_of
        self.neighbours_of = neighbours_of
        self.on_live = on_live  # called as a fact's KV goes live (the shard records its neighbours)
        self.encode_timeout_s = encode_timeout_s
        self.name = name
        self.context_tokens = context_tokens  # the engine's context: encode prompts + 1 token fit in it
        self.max_attempts = max_attempts
        self.facts: dict[str, FactKV] = {}
        self.queue = FairQueue()  # users served round robin
        self.in_flight: dict[str, EncodeJob] = {}
        self.lru = FloorLRU(arena_floor)  # facts with live KV, least recently used first, per user
        self.dependents: dict[str, set[str]] = {}  # fact id -> the facts encoded behind it (encode_neighbours)
        self.prefix = FactKV(user_id="", version=1, text=instruction, segment_ids=tuple(layout.prefix_ids))
        self.facts_encoded = 0
        self.evictions = 0  # live entries released to make room (their facts are prefilled as text until used)

    # ------------------------------------------------------------------ start-up
    def adopt_arena(self, encoded_behind: Mapping[str, tuple[int, tuple[str, ...]]] | None = None) -> dict[str, int]:
        """Take over what a previous incarnation left in the arena (call after tracking every fact).

        LIVE entries whose tag and tokens match a tracked fact (or the prefix) become its KV; every
        other entry is released (a pinned one retires until its request ends, or until the next
        engine's scheduler clears the pins of a dead one). Only facts left without KV stay queued.
        `encoded_behind` (fact id -> (version, neighbour ids), as recorded when its KV went live)
        says which neighbours each entry's tag should name."""
        for key, state in self.facts.items():
            version, neighbours = (encoded_behind or {}).get(key, (state.version, ()))
            if version == state.version and all(n in self.facts for n in neighbours):
                self._set_neighbours(key, state, neighbours)
        wanted = {self._tag(key, state): (key, state) for key, state in self.facts.items()}
        wanted[entry_tag(PREFIX_KEY, self.prefix.version)] = (PREFIX_KEY, self.prefix)
        adopted = released = 0
        for ref, tag, tokens in self.arena.live_entries():
            key, state = wanted.get(tag, (None, None))
            if state is None or state.ref is not None or tuple(tokens.tolist()) != state.segment_ids:
                self.arena.release(ref)
                released += 1
                continue
            state.ref = ref
            if key != PREFIX_KEY:
                self.lru.add(key, state.user_id)
            adopted += 1
        entries = self.arena.entries
        for entry_id in np.flatnonzero(entries["state"] == WRITING):  # captures of the previous incarnation
            try:
                released += self.arena.release(EntryRef(int(entry_id), int(entries[entry_id]["generation"])))
            except ArenaError:
                pass
        keys = [PREFIX_KEY, *self.facts] if self.prefix.ref is None else list(self.facts)
        self.queue = FairQueue()
        for key in keys:
            if key == PREFIX_KEY or self.facts[key].ref is None:
                self.queue.append(key, self._user_of(key))
        return {"adopted": adopted, "released": released, "queued": len(self.queue)}

    # ------------------------------------------------------------------ facts in and out
    def track(self, record: FactRecord, urgent: bool = False) -> None:
        """Know a fact (new, or a new version of one) and queue its encoding (first when urgent:
        a caller waits for it, unlike the backlog of a restart)."""
        if (old := self.facts.get(record.fact_id)) is not None:
            self._set_neighbours(record.fact_id, old, ())
        self.facts[record.fact_id] = FactKV(
            user_id=record.user_id,
            version=record.version,
            text=record.text,
            segment_ids=tuple(self.layout.fact_ids(record.text)),
            source_id=record.source_id,
        )
        if urgent:
            self.queue.appendleft(record.fact_id, record.user_id)
        else:
            self.queue.append(record.fact_id, record.user_id)

    def forget(self, fact_id: str) -> None:
        self.drop_kv(fact_id)
        if (state := self.facts.pop(fact_id, None)) is not None:
            self._set_neighbours(fact_id, state, ())
        self.queue.remove(fact_id)

    def drop_kv(self, fact_id: str) -> None:
        """Release the fact's live entry. An entry still being captured is left to its job: the
        capture may still be writing, and complete_jobs releases it once the job no longer
        matches the fact (deleted, or re-tracked by an update)."""
        state = self.facts.get(fact_id)
        if state is not None and state.ref is not None:
            self.arena.release(state.ref)  # retires it if a request still pins it
            state.ref = None
            self.lru.discard(fact_id)

    def reencode_dependents(self, fact_id: str) -> int:
        """Facts encoded behind `fact_id` (a neighbour that was just updated or deleted) lose their
        KV and are queued again, so no injected KV carries the old text; until then they are
        prefilled as text. Returns how many."""
        dependents = [key for key in self.dependents.pop(fact_id, ()) if key in self.facts and key != fact_id]
        for key in dependents:
            self.drop_kv(key)
            state = self.facts[key]
            self._set_neighbours(key, state, ())
            state.encoding = None  # a capture in flight holds the old text: complete_jobs releases it
            if key not in self.queue:
                self.queue.append(key, state.user_id)
        return len(dependents)

    def _neighbours(self, key: str, state: FactKV) -> list[tuple[str, str]]:
        if self.neighbours_of is None:
            return []
        return [(fact_id, text) for fact_id, text in self.neighbours_of(key, state) if fact_id != key and fact_id in self.facts]

    def _tag(self, key: str, state: FactKV) -> bytes:
        """The arena tag of the entry encoding `state` now: its key, version and neighbours."""
        return entry_tag(key, state.version, [(n, self.facts[n].version) for n in state.neighbours])

    def _set_neighbours(self, key: str, state: FactKV, neighbours: tuple[str, ...]) -> None:
        for old in state.neighbours:
            if (keys := self.dependents.get(old)) is not None:
                keys.discard(key)
                if not keys:
                    del self.dependents[old]
        state.neighbours = neighbours
        for new in neighbours:
            self.dependents.setdefault(new, set()).add(key)

    def use(self, fact_id: str) -> FactKV:
        """A fact a request is about to use: fresh in the LRU, or queued again if its KV is gone."""
        state = self.facts[fact_id]
        if state.ref is not None:
            self.lru.touch(fact_id)
        elif state.encoding is None and not state.failed and fact_id not in self.queue:
            self.queue.append(fact_id, state.user_id)  # evicted: re-encode on use
        return state

    # ------------------------------------------------------------------ encoding
    def take_jobs(self, max_jobs: int, max_tokens: int | None = None, engine_slot: int = 0) -> list[EncodeJob]:
        """Allocate arena entries for queued facts and hand out their capture jobs to the engine in
        `engine_slot`: at most `max_jobs`, and at most `max_tokens` prompt tokens in all (a batch
        the engine finishes within its timeout; the first job is always taken, however long)."""
        self.expire_jobs()
        jobs: list[EncodeJob] = []
        batch_tokens = 0
        arena_full_for: set[str] = set()  # users whose next fact found no room: serve the others
        while len(jobs) < max_jobs and (taken := self.queue.take(arena_full_for)) is not None:
            key, user = taken
            state = self.prefix if key == PREFIX_KEY else self.facts.get(key)
            if state is None or state.ref is not None or state.encoding is not None or state.failed:
                continue
            try:
                tokens, start, length = self._encode_tokens(key, state)
                if jobs and max_tokens is not None and batch_tokens + len(tokens) > max_tokens:
                    self.queue.appendleft(key, user, user_next=True)  # first in the next batch
                    break
                batch_tokens += len(tokens)
                ref = self._allocate(tokens[start : start + length], start, self._tag(key, state), user)
            except ArenaFull as exc:
                logger.warning("%s: %s; %s stays prefilled as text", self.name, exc, key)
                self.queue.appendleft(key, user, user_next=True)
                arena_full_for.add(user)
                continue
            except (ArenaError, ValueError) as exc:  # cannot ever fit: no point in retrying
                self._give_up(key, state, str(exc))
                continue
            salt = self.salt_of(state.user_id) if self.salt_of is not None and key != PREFIX_KEY else None
            job = EncodeJob(f"{key}:{state.version}:{ref.entry_id}:{ref.generation}", key, state.version, ref.entry_id,
                            ref.generation, tokens, start, length, time.time(), salt, engine_slot)
            state.encoding = job
            self.in_flight[job.job_id] = job
            jobs.append(job)
        return jobs

    def _encode_tokens(self, key: str, state: FactKV) -> tuple[list[int], int, int]:
        if key == PREFIX_KEY:
            return list(self.prefix.segment_ids), 0, len(self.prefix.segment_ids)
        limit = None if self.context_tokens is None else self.context_tokens - 1  # one generated token
        neighbours = self._neighbours(key, state)
        prompt = self.layout.encode_prompt(state.text, self.window_of(state), limit, [text for _, text in neighbours])
        self._set_neighbours(key, state, tuple(fact_id for fact_id, _ in neighbours))
        return prompt.token_ids, prompt.start, prompt.length

    def complete_jobs(self, outcomes: Mapping[str, EncodeOutcome]) -> int:
        """Commit the captured entries (job id -> EncodeOutcome); returns how many facts went live.
        A failed job is retried until the fact's attempts run out; a job not run is retried."""
        live = 0
        for job_id, outcome in outcomes.items():
            job = self.in_flight.pop(job_id, None)
            if job is None:
                continue
            ref = EntryRef(job.entry, job.generation)
            state = self._state_of_job(job)
            if state is None or outcome is not True:
                self.arena.release(ref)
                if state is not None:
                    state.encoding = None
                    self._failed(job.key, state, outcome)
                continue
            try:
                self.arena.commit(ref)
            except ArenaError as exc:  # released underneath the capture
                state.encoding = None
                self._failed(job.key, state, f"entry not committed: {exc}")
                continue
            state.ref, state.encoding, state.error = ref, None, None
            if job.key != PREFIX_KEY:
                self.lru.add(job.key, state.user_id)
                self.facts_encoded += 1
                if self.on_live is not None:
                    self.on_live(job.key, state)
            live += 1
        return live

    def _failed(self, key: str, state: FactKV, outcome: EncodeOutcome) -> None:
        if outcome is None:  # never ran (the engine died or restarts): not the fact's fault
            self.queue.append(key, state.user_id)
            return
        state.attempts += 1
        state.error = outcome if isinstance(outcome, str) else "the engine did not capture the fact's KV"
        if state.attempts >= self.max_attempts:
            self._give_up(key, state, state.error)
        else:
            logger.warning("%s: encode of %s failed (%d of %d): %s", self.name, key, state.attempts, self.max_attempts, state.error)
            self.queue.append(key, state.user_id)

    def _give_up(self, key: str, state: FactKV, reason: str) -> None:
        state.failed, state.error = True, reason
        logger.error("%s: %s is served as text from now on: %s", self.name, key, reason)

    def pending(self, user_id: str | None = None) -> int:
        """Facts queued or being encoded: the shard's, or one user's."""
        if user_id is None:
            return len(self.queue) + len(self.in_flight)
        return self.queue.queued_of(user_id) + sum(1 for job in self.in_flight.values() if self._user_of(job.key) == user_id)

    def _user_of(self, key: str) -> str:
        return self.prefix.user_id if key == PREFIX_KEY else self.facts[key].user_id if key in self.facts else ""

    def pending_of(self, keys: Collection[str]) -> list[str]:
        """The keys among `keys` still queued or being encoded."""
        queued = set(self.queue)
        return [k for k in keys if (state := self.facts.get(k)) is not None and (k in queued or state.encoding is not None)]

    def status(self, key: str) -> dict[str, Any]:
        """The fact's KV as an API reports it: kv (live | encoding | queued | failed | evicted),
        kv_error (why the last encode failed), kv_attempts."""
        state = self.facts[key]
        if state.ref is not None:
            kv = "live"
        elif state.encoding is not None:
            kv = "encoding"
        elif state.failed:
            kv = "failed"
        else:
            kv = "queued" if key in self.queue else "evicted"
        return {"kv": kv, "kv_error": state.error, "kv_attempts": state.attempts}

    def failures(self, limit: int = 20) -> list[dict[str, Any]]:
        """Facts whose encoding was given up (first `limit`): id, attempts, reason."""
        failed = [(key, state) for key, state in self.facts.items() if state.failed]
        return [{"fact_id": key, "attempts": state.attempts, "reason": state.error} for key, state in failed[:limit]]

    def _state_of_job(self, job: EncodeJob) -> FactKV | None:
        """The state the job is still encoding for; None once its fact was deleted or updated."""
        state = self.prefix if job.key == PREFIX_KEY else self.facts.get(job.key)
        if state is None or state.encoding is None or state.encoding.job_id != job.job_id:
            return None
        return state

    def release_jobs_of(self, engine_slot: int) -> int:
        """The engine in `engine_slot` is new (its replica was replaced): the jobs its predecessor
        took will never be reported back, so they are released and retried now, not after
        encode_timeout_s. Returns how many."""
        taken = [job_id for job_id, job in self.in_flight.items() if job.engine_slot == engine_slot]
        if taken:
            logger.warning("%s: %d encode jobs of the engine replaced in slot %d are retried", self.name, len(taken), engine_slot)
            self.complete_jobs({job_id: None for job_id in taken})
        return len(taken)

    def expire_jobs(self) -> None:
        """Jobs never reported back (their replica died mid-encode) are released and retried."""
        deadline = time.time() - self.encode_timeout_s
        for job_id, job in list(self.in_flight.items()):
            if job.issued_at < deadline:
                logger.warning("%s: encode job %s was not reported back; retrying", self.name, job_id)
                self.complete_jobs({job_id: None})

    def _allocate(self, token_ids: list[int], encode_start: int, tag: bytes, user: str) -> EntryRef:
        """Allocate an entry for a fact of `user`, evicting the least recently used facts' KV when
        the arena is full, never another user's below their floor (FloorLRU.victims_for).
        Pinned entries are never victims: releasing one would free nothing until its request ends."""
        while True:
            try:
                return self.arena.allocate(token_ids, encode_start, tag)
            except ArenaFull:
                victim = next((k for k in self.lru.victims_for(user) if not self.arena.is_pinned(self.facts[k].ref)), None)
                if victim is None:
                    raise
                self.lru.discard(victim)
                state = self.facts[victim]
                self.arena.release(state.ref)
                state.ref = None  # prefilled as text until used again
                self.evictions += 1
