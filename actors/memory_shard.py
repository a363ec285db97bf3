"""MemoryShard: the state one engine's users' memory lives in (run as a Ray actor per GPU/engine).

A shard owns, for the users assigned to it:
- the durable fact records, through FactStore (Redis is the source of truth);
- the vector index over fact embeddings (actors.vector_index: exact torch or cuVS CAGRA);
- the fact KV arena (connector.fact_arena), shared with the engine's connector: the shard
  allocates, commits and releases entries; the engine captures into them and injects them.

Encoding needs the engine, which lives in the LLM replica, so the shard hands out encode jobs
(take_encode_jobs) and the replica's EncodeDriver runs them as capture requests and reports
back (complete_encode_jobs). A fact is acknowledged once it is in Redis and the index; its KV
follows. Until then, and whenever its KV is missing (evicted, still encoding), a retrieved fact
is prefilled as text after the injected ones: the answer never depends on whether KV exists.

On (re)start the shard resets its arena and rebuilds index and KV from Redis, so killing it
loses nothing that was acknowledged.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from actors.embedder import Embedder
from actors.fact_store import FactEvent, FactRecord, FactStore, NewFact, Turn
from actors.prompting import PromptLayout
from actors.settings import MemorySettings
from actors.vector_index import build_index
from connector.composition import StoredSegment, compose
from connector.fact_arena import FREE, ArenaError, ArenaFull, EntryRef, FactArena
from connector.params import EntryPlacement, KVMemoryParams

logger = logging.getLogger(__name__)

PREFIX_KEY = "__prefix__"  # the instruction prefix's arena entry, next to the facts'


@dataclass
class _FactKV:
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


@dataclass
class MemoryHit:
    fact_id: str
    text: str
    score: float
    source_id: str | None = None


@dataclass
class ChatPlan:
    """A memory-conditioned prompt: token ids, and what to hand the engine for KV injection."""

    prompt_token_ids: list[int]
    mode: str  # "kv" | "prompt" | "none"
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    facts: list[MemoryHit] = field(default_factory=list)
    injected_tokens: int = 0  # tokens the connector will supply (prefix + facts with KV)
    prefilled_fact_ids: list[str] = field(default_factory=list)  # retrieved but without KV yet


class MemoryShard:
    """See the module docstring. Methods are called one at a time (a Ray actor's default)."""

    def __init__(
        self,
        shard_id: int,
        settings: MemorySettings,
        model_dir: str,
        kv_dtype: str,
        redis_url: str,
        namespace: str = "default",
    ) -> None:
        from transformers import AutoTokenizer

        from connector.engine_config import arena_geometry_for

        self.shard_id = shard_id
        self.settings = settings
        self.store = FactStore.from_url(redis_url, settings.redis_prefix)
        self.layout = PromptLayout(AutoTokenizer.from_pretrained(model_dir), settings.instruction)
        embed_device = settings.embedding_device
        if embed_device == "auto":
            import torch

            embed_device = "cuda" if torch.cuda.is_available() else "cpu"
        self.embedder = Embedder(settings.embedding_model, device=embed_device)
        self.index = build_index(settings.index, self.embedder.dim)
        geometry = arena_geometry_for(model_dir, kv_dtype, **settings.arena.model_dump(exclude={"device_pages"}))
        self._arena_path = Path(settings.arena_dir) / f"kvmem-{namespace}-shard{shard_id}"
        try:
            self.arena = FactArena.create(self._arena_path, geometry, exist_ok=True)
        except ArenaError:  # left by a run with other settings: its KV is derived, start afresh
            logger.warning("shard %d: replacing the arena at %s (geometry changed)", shard_id, self._arena_path)
            shutil.rmtree(self._arena_path)
            self.arena = FactArena.create(self._arena_path, geometry)
        self.facts: dict[str, _FactKV] = {}
        self.queue: deque[str] = deque()
        self.in_flight: dict[str, EncodeJob] = {}
        self.lru: OrderedDict[str, None] = OrderedDict()  # facts with live KV, least recently used first
        self.prefix = _FactKV(user_id="", version=1, text=settings.instruction, segment_ids=tuple(self.layout.prefix_ids))
        self.facts_encoded = 0
        self._reset_arena()
        self._rebuild()

    # ================================================================== start-up
    def _reset_arena(self) -> None:
        """Release every entry a previous incarnation left (pinned ones retire until unpinned)."""
        entries = self.arena.entries
        for entry_id in np.flatnonzero(entries["state"] != FREE):
            ref = EntryRef(int(entry_id), int(entries[entry_id]["generation"]))
            try:
                self.arena.release(ref)
            except ArenaError:
                pass

    def _rebuild(self) -> None:
        start = time.perf_counter()
        self.queue.append(PREFIX_KEY)
        users = self.store.users_of_shard(self.shard_id)
        n = 0
        for user_id in users:
            rows = self.store.all_with_embeddings(user_id)
            if not rows:
                continue
            self.index.add([r.fact_id for r, _ in rows], [user_id] * len(rows), np.stack([e for _, e in rows]))
            for record, _ in rows:
                self._track(record)
            n += len(rows)
        logger.info("shard %d rebuilt %d facts of %d users from Redis in %.2fs", self.shard_id, n, len(users), time.perf_counter() - start)

    def _track(self, record: FactRecord) -> None:
        self.facts[record.fact_id] = _FactKV(
            user_id=record.user_id,
            version=record.version,
            text=record.text,
            segment_ids=tuple(self.layout.fact_ids(record.text)),
            source_id=record.source_id,
        )
        self.queue.append(record.fact_id)

    # ================================================================== identity
    def arena_path(self) -> str:
        return str(self._arena_path)

    def ready(self) -> dict[str, Any]:
        return {"shard": self.shard_id, "facts": len(self.facts), "arena": self.arena_path(), "pid": os.getpid()}

    # ================================================================== writes
    def add_turns(self, user_id: str, turns: Sequence[Turn]) -> None:
        self.store.claim_user(user_id, self.shard_id)
        self.store.add_turns(user_id, list(turns))

    def next_turn_order(self, user_id: str) -> float:
        return self.store.last_turn_order(user_id) + 1.0

    def add_facts(self, user_id: str, facts: Sequence[NewFact]) -> list[dict[str, Any]]:
        """Store, embed and index facts; queue their encoding. Returns one Mem0-style result per
        fact ({"id", "memory", "event": "ADD" | "NONE"}); NONE means the fact already existed."""
        facts = [NewFact.model_validate(f) for f in facts]
        if not facts:
            return []
        self.store.claim_user(user_id, self.shard_id)
        embeddings = self.embedder.embed([f.text for f in facts])
        results = []
        for fact, embedding in zip(facts, embeddings):
            record, created = self.store.add(user_id, fact, embedding)
            if created or record.fact_id not in self.facts:
                self.index.add([record.fact_id], [user_id], embedding[None, :])
                self._track(record)
            results.append({"id": record.fact_id, "memory": record.text, "event": "ADD" if created else "NONE"})
        return results

    def update(self, fact_id: str, user_id: str, text: str) -> FactRecord:
        """New text, new embedding, new KV; the old KV is released and never injected again."""
        embedding = self.embedder.embed([text])[0]
        record = self.store.update(fact_id, user_id, text, embedding)
        self._drop_kv(fact_id)
        self.index.add([fact_id], [user_id], embedding[None, :])
        self._track(record)
        return record

    def delete(self, fact_id: str, user_id: str) -> FactRecord:
        record = self.store.delete(fact_id, user_id)
        self._forget(fact_id)
        return record

    def delete_all(self, user_id: str) -> int:
        ids = self.store.delete_all(user_id)
        for fact_id in ids:
            self._forget(fact_id)
        self.index.clear_user(user_id)
        return len(ids)

    def _forget(self, fact_id: str) -> None:
        self._drop_kv(fact_id)
        self.facts.pop(fact_id, None)
        self.index.remove([fact_id])
        try:
            self.queue.remove(fact_id)
        except ValueError:
            pass

    def _drop_kv(self, fact_id: str) -> None:
        """Release the fact's live entry. An entry still being captured is left to its job: the
        capture may still be writing, and complete_encode_jobs releases it once the job no longer
        matches the fact (deleted, or re-tracked by an update)."""
        state = self.facts.get(fact_id)
        if state is not None and state.ref is not None:
            self.arena.release(state.ref)  # retires it if a request still pins it
            state.ref = None
            self.lru.pop(fact_id, None)

    # ================================================================== reads
    def get(self, fact_id: str, user_id: str | None = None) -> FactRecord:
        return self.store.get(fact_id, user_id)

    def get_all(self, user_id: str) -> list[FactRecord]:
        return self.store.get_all(user_id)

    def history(self, fact_id: str, user_id: str | None = None) -> list[FactEvent]:
        return self.store.history(fact_id, user_id)

    def search(self, user_id: str, query: str, k: int) -> list[MemoryHit]:
        if k <= 0:
            return []
        (hits,) = self.index.search(user_id, self.embedder.embed([query])[0], k)
        out = []
        for hit in hits:
            state = self.facts.get(hit.fact_id)
            if state is None or state.user_id != user_id:  # never another user's fact
                continue
            out.append(MemoryHit(hit.fact_id, state.text, float(hit.score), state.source_id))
        return out

    def plan_chat(
        self,
        user_id: str,
        messages: Sequence[dict[str, str]],
        k: int | None = None,
        mode: str = "kv",
        max_prompt_tokens: int | None = None,
    ) -> ChatPlan:
        """The prompt for a chat request with the user's top-k facts.

        mode "kv": facts with live KV are injected; "prompt": the same token ids, all prefilled
        (Mem0-style prompt injection); "none": the plain conversation, no memory.
        max_prompt_tokens: the least relevant facts are left out until the prompt fits (the
        caller rejects a conversation that does not fit even without memory).
        """
        if mode == "none":
            return ChatPlan(prompt_token_ids=self.layout.plain_prompt_ids(messages), mode=mode)
        k = self.settings.top_k if k is None else k
        query = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        hits = self.search(user_id, query, k) if query else []
        suffix = self.layout.suffix_ids(messages)
        if max_prompt_tokens is not None:
            room = max_prompt_tokens - len(self.layout.prefix_ids) - len(suffix)
            kept: list[MemoryHit] = []
            for hit in hits:  # most relevant first
                room -= len(self.facts[hit.fact_id].segment_ids)
                if room < 0:
                    break
                kept.append(hit)
            hits = kept
        ordered = list(reversed(hits))  # least relevant first, most relevant next to the query
        if mode == "prompt" or self.prefix.ref is None:
            tokens = list(self.layout.prefix_ids)
            for hit in ordered:
                tokens += self.layout.fact_ids(hit.text)
            return ChatPlan(prompt_token_ids=tokens + suffix, mode="prompt", facts=hits)
        segments = [StoredSegment(self.prefix.ref, self.prefix.segment_ids)]
        pending: list[int] = []
        pending_ids: list[str] = []
        for hit in ordered:
            state = self.facts[hit.fact_id]
            if state.ref is not None:
                segments.append(StoredSegment(state.ref, state.segment_ids))
                self.lru.move_to_end(hit.fact_id)
            else:
                pending += state.segment_ids
                pending_ids.append(hit.fact_id)
                if state.encoding is None and hit.fact_id not in self.queue:
                    self.queue.append(hit.fact_id)  # evicted: re-encode on use
        composed = compose(segments, pending + suffix, namespace=f"{self.settings.redis_prefix}:{user_id}")
        return ChatPlan(
            prompt_token_ids=composed.prompt_token_ids,
            mode="kv",
            kv_transfer_params=composed.kv_transfer_params(),
            cache_salt=composed.cache_salt,
            facts=hits,
            injected_tokens=composed.memory_end,
            prefilled_fact_ids=pending_ids,
        )

    # ================================================================== encoding
    def take_encode_jobs(self, max_jobs: int | None = None) -> list[EncodeJob]:
        """Allocate arena entries for queued facts and hand out their capture jobs."""
        max_jobs = max_jobs or self.settings.encode_batch
        self._expire_jobs()
        jobs: list[EncodeJob] = []
        while self.queue and len(jobs) < max_jobs:
            key = self.queue.popleft()
            state = self.prefix if key == PREFIX_KEY else self.facts.get(key)
            if state is None or state.ref is not None or state.encoding is not None:
                continue
            if key == PREFIX_KEY:
                tokens, start, length = list(self.prefix.segment_ids), 0, len(self.prefix.segment_ids)
            else:
                window = self.store.window_before(state.user_id, state.source_id, self.settings.window_turns)
                prompt = self.layout.encode_prompt(state.text, window)
                tokens, start, length = prompt.token_ids, prompt.start, prompt.length
            try:
                ref = self._allocate(tokens[start : start + length], start)
            except ArenaFull as exc:
                logger.warning("shard %d: %s; %s stays prefilled as text", self.shard_id, exc, key)
                self.queue.appendleft(key)
                break
            job = EncodeJob(f"{key}:{state.version}:{ref.entry_id}:{ref.generation}", key, state.version, ref.entry_id,
                            ref.generation, tokens, start, length, time.time())
            state.encoding = job
            self.in_flight[job.job_id] = job
            jobs.append(job)
        return jobs

    def complete_encode_jobs(self, outcomes: dict[str, bool]) -> int:
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
                logger.warning("shard %d: %s not committed (%s); retrying", self.shard_id, job_id, exc)
                state.encoding = None
                self.queue.append(job.key)
                continue
            state.ref, state.encoding = ref, None
            if job.key != PREFIX_KEY:
                self.lru[job.key] = None
                self.facts_encoded += 1
            live += 1
        return live

    def pending_encodes(self) -> int:
        return len(self.queue) + len(self.in_flight)

    def _state_of_job(self, job: EncodeJob) -> _FactKV | None:
        """The state the job is still encoding for; None once its fact was deleted or updated."""
        state = self.prefix if job.key == PREFIX_KEY else self.facts.get(job.key)
        if state is None or state.encoding is None or state.encoding.job_id != job.job_id:
            return None
        return state

    def _expire_jobs(self) -> None:
        """Jobs never reported back (a replica died mid-encode) are released and retried."""
        deadline = time.time() - self.settings.encode_timeout_s
        for job_id, job in list(self.in_flight.items()):
            if job.issued_at < deadline:
                logger.warning("shard %d: encode job %s timed out; retrying", self.shard_id, job_id)
                self.complete_encode_jobs({job_id: False})

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

    # ================================================================== accounting
    def stats(self) -> dict[str, Any]:
        usage = self.arena.usage()
        return {
            "shard": self.shard_id,
            "facts": len(self.facts),
            "facts_with_kv": len(self.lru),
            "facts_encoded_total": self.facts_encoded,
            "pending_encodes": self.pending_encodes(),
            "index_vectors": len(self.index),
            "host_bytes_used": usage["bytes_host"],
            "host_bytes_capacity": self.arena.geometry.kv_bytes(),
            "device_bytes_used": usage["bytes_device"],  # pages the engine's HBM tier holds too
            **usage,
        }
