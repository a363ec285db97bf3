"""MemoryShard: the state one engine's users' memory lives in (actors.shard_actor runs it as a Ray actor).

A shard owns, for the users assigned to it:
- the durable fact records, through FactStore (Redis is the source of truth);
- the vector index over fact embeddings (memory.index: exact torch or cuVS CAGRA) and the
  keyword index beside it (memory.retrieval: per-user BM25, fused with the dense search);
- the fact KV arena (kvarena.arena), shared with the engine's connector: the shard
  allocates, commits and releases entries (memory.kv_lifecycle); the engine captures into
  them and injects them; memory.planner composes the chat prompts.

Encoding needs the engine, which lives in the LLM replica, so the shard hands out encode jobs
(take_encode_jobs) and the replica's EncodeDriver runs them as capture requests and reports
back (complete_encode_jobs). A fact is acknowledged once it is in Redis and the index; its KV
follows. Until then, and whenever its KV is missing (evicted, still encoding), a retrieved fact
is prefilled as text after the injected ones: the answer never depends on whether KV exists.

On (re)start the shard rebuilds its index from Redis and adopts the arena's live entries that
match its facts (memory.kv_lifecycle.adopt_arena): the arena lives in shared memory and
survives the shard's and the replica's processes, so a restart re-encodes only what is missing,
and killing the shard loses nothing that was acknowledged. A write whose Redis call fails may still
have been applied (Redis died before answering): its user is marked unsure, and on the user's next
call that uses Redis, and on the encode driver's poll (never on the chat path), the shard re-reads
that user's records and takes Redis's word (memory.read_repair: adopts records it lacks, drops ones
Redis no longer has, takes new versions). An encode that keeps failing is
given up after `max_encode_attempts`; the fact is then served as text and its record (get) and
the shard's stats say why.

Erasure: a delete (of a fact, or of a user) is acknowledged once its Redis transaction is on disk;
its arena entry is freed, which zeroes its token ids and KV bytes (kvarena), it leaves the vector
and keyword indexes, and memory.erasure.RedisCompactor rewrites Redis's files soon after, coalesced
and rate-limited, so the text leaves the append-only file and any RDB snapshot too.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any, Sequence

import numpy as np
import torch  # already loaded by the index backends (memory.index.factory)

from kvarena.arena import ArenaError, FactArena, arena_geometry_for
from memory.composition import user_namespace, user_salt
from memory.chat_query import ChatQuery
from memory.embedder import Embedder
from memory.erasure import RedisCompactor
from memory.fact_selection import FactSelector
from memory.fact_store import FactStore
from memory import adding
from memory.add_plan import AddBatch, AddCommit, AddPlan, AddResult, FactOutcome
from memory.records import FactEvent, FactRecord, MemoryHit, NewFact, Turn
from memory.index import build_index
from memory.kv_lifecycle import PREFIX_KEY, EncodeJob, EncodeOutcome, FactKV, FactKVLifecycle
from memory.kv_records import StoredFact
from memory.planner import ChatPlan, plan_chat
from memory.quota import redis_memory_report
from memory.prompting import PromptLayout
from memory.read_repair import ReadRepair
from memory.retrieval import Retriever, store_turn_texts
from memory.settings import MemorySettings
from memory.start_clock import Laps

logger = logging.getLogger(__name__)

REDIS_MEMORY_EVERY_S = 5.0  # Redis's INFO memory read at most this often (stats, every 10 s from the replica)

__all__ = ["MemoryShard", "StoredFact", "ChatPlan", "ChatQuery", "MemoryHit", "EncodeJob", "PREFIX_KEY"]


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
        redis_password: str | None = None,
    ) -> None:
        from transformers import AutoTokenizer  # transformers: paid by a shard's start, not by importing its names

        lap = Laps()  # the start's phases, in ready() and stats()
        self.shard_id = shard_id
        self.settings = settings
        self.store = FactStore.from_url(
            redis_url, settings.redis_prefix, timeout_s=settings.redis_timeout_s, password=redis_password, quota=settings.quota
        )
        # the arena first: a restarting replica may open it (engine start) while the rest loads
        geometry = arena_geometry_for(model_dir, kv_dtype, **settings.arena.model_dump(exclude={"device_pages"}))
        self._arena_path = settings.arena_path(namespace, shard_id)
        try:
            self.arena = FactArena.create(self._arena_path, geometry, exist_ok=True)
        except ArenaError:  # left by a run with other settings: its KV is derived, start afresh
            logger.warning("shard %d: replacing the arena at %s (geometry changed)", shard_id, self._arena_path)
            shutil.rmtree(self._arena_path)
            self.arena = FactArena.create(self._arena_path, geometry)
        lap("redis_and_arena")
        self.layout = PromptLayout(AutoTokenizer.from_pretrained(model_dir), settings.instruction, settings.window_bridge, settings.memory_closing)
        lap("tokenizer")
        embed_device = settings.embedding_device
        if embed_device == "auto":
            embed_device = "cuda" if torch.cuda.is_available() else "cpu"
        self.embedder = Embedder(settings.embedding_model, device=embed_device)
        lap("embedder")
        self.index = build_index(settings.index, self.embedder.dim)
        self.retrieval = Retriever(settings.retrieval, self.index, store_turn_texts(self.store))  # + keyword index
        self.kv = FactKVLifecycle(
            self.arena,
            self.layout,
            settings.instruction,
            window_of=self._window_of,
            neighbours_of=self._neighbours_of if settings.encode_neighbours else None,
            on_live=self._record_encoded_behind,
            encode_timeout_s=settings.encode_timeout_s,
            name=f"shard {shard_id}",
            context_tokens=settings.encode_context_tokens,
            max_attempts=settings.max_encode_attempts,
            salt_of=lambda user_id: user_salt(settings.redis_prefix, user_id),
            arena_floor=settings.arena_floor_entries_per_user,
        )
        self.facts: dict[str, FactKV] = self.kv.facts  # fact id -> its KV state (the same dict)
        self.selector = FactSelector(
            retriever=self.retrieval, embedder=self.embedder, facts=self.facts, layout=self.layout, default_top_k=settings.top_k
        )
        self._redis_memory: tuple[float, dict[str, Any]] = (-REDIS_MEMORY_EVERY_S, {})  # (read at, report)
        self.read_repair = ReadRepair(self)  # users whose last write's Redis call failed (module docstring)
        self.compactor = RedisCompactor(self.store.r, self.store.keys.erasure_pending(), settings.erasure, name=f"shard {shard_id}")
        self._rebuild()  # Redis reads and the index's build (index_graph_build_s: CAGRA's share of it)
        lap("rebuild")
        self.start_phases = {**lap.total(), "index_graph_build_s": round(getattr(self.index, "stats", {}).get("last_build_s", 0.0), 2)}
        self.compactor.resume()  # a rewrite a previous incarnation owed

    # ================================================================== start-up
    def _rebuild(self) -> None:
        start = time.perf_counter()
        users = self.store.users_of_shard(self.shard_id)
        n = 0
        for user_id in users:
            rows = self.store.all_with_embeddings(user_id)
            if not rows:
                continue
            self.index.add([r.fact_id for r, _ in rows], [user_id] * len(rows), np.stack([e for _, e in rows]))
            self.retrieval.track(r for r, _ in rows)
            for record, _ in rows:
                self.kv.track(record)
            n += len(rows)
        arena = self.kv.adopt_arena(self.store.encoded_behind(list(self.facts)))
        logger.info("shard %d rebuilt %d facts of %d users from Redis in %.2fs; arena: %s",
                    self.shard_id, n, len(users), time.perf_counter() - start, arena)

    def _window_of(self, state: FactKV) -> list[Turn]:
        return self.store.window_before(state.user_id, state.source_id, self.settings.window_turns)

    def _record_encoded_behind(self, fact_id: str, state: FactKV) -> None:
        if not (state.neighbours or self.settings.encode_neighbours):
            return
        try:
            self.store.record_encoded_behind(fact_id, state.version, state.neighbours)
        except Exception as exc:  # lost, a restart re-encodes this fact instead of adopting its KV
            logger.warning("shard %d: could not record what %s was encoded behind: %s", self.shard_id, fact_id, exc)

    def _neighbours_of(self, fact_id: str, state: FactKV) -> list[tuple[str, str]]:
        """The user's facts closest to this one (memory.encode_neighbours), least similar first."""
        n = self.settings.encode_neighbours
        _, vector = self.store.get_with_embedding(fact_id, state.user_id)  # the stored embedding, not a new one
        hits = self.selector.top_k(state.user_id, vector, n + 1)
        neighbours = [(hit.fact_id, hit.text) for hit in hits if hit.fact_id != fact_id][:n]
        return neighbours[::-1]  # the closest right before the fact

    # ================================================================== identity
    def arena_path(self) -> str:
        return str(self._arena_path)

    def ready(self) -> dict[str, Any]:
        return {"shard": self.shard_id, "facts": len(self.facts), "arena": self.arena_path(), "pid": os.getpid(), "start_phases": self.start_phases}

    def health(self) -> str:
        """"ok", or what is wrong (Redis unreachable): the shard's half of the replica's health report."""
        try:
            self.store.r.ping()
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            return f"redis unreachable: {exc}"
        return "ok"

    # ================================================================== writes
    def prepare_add(self, batch: AddBatch) -> AddPlan:
        """An add's checks (encode backlog, quotas: 429 before the engine decides anything) and its
        extracted facts' reconcile candidates, in one call (memory.adding, memory.add_plan)."""
        return adding.prepare(self, batch)

    def commit_add(self, commit: AddCommit) -> AddResult:
        """An add's writes, checked again with nothing of the shard in between: turns, the model's
        UPDATE / DELETE / NONE, the new facts (memory.adding, memory.add_plan)."""
        return adding.commit(self, commit)

    def add_facts(self, user_id: str, facts: Sequence[NewFact]) -> list[FactOutcome]:
        """Facts stored as given: commit_add of a batch of given facts (tests and scripts seed a
        shard in process with this; the replica's adds go through prepare_add and commit_add)."""
        batch = AddBatch(user_id=user_id, given=[NewFact.model_validate(f) for f in facts])
        return list(self.commit_add(AddCommit(batch=batch)).outcomes)

    def update(self, fact_id: str, user_id: str, text: str, metadata: dict[str, Any] | None = None) -> FactRecord:
        """New text (and metadata, when given), new embedding, new KV; the old KV is released and
        never injected again."""
        embedding = self.embedder.embed([text])[0]
        self.read_repair.repair(user_id)
        with self.read_repair.writing(user_id):
            record = self.store.update(fact_id, user_id, text, embedding, metadata)
        self.track_version(record, embedding)
        return record

    def delete(self, fact_id: str, user_id: str) -> FactRecord:
        self.read_repair.repair(user_id)
        try:
            with self.read_repair.writing(user_id):
                record = self.store.delete(fact_id, user_id)
        finally:  # even when the reply was lost (the delete may have landed): the text leaves
            self.compactor.request()  # Redis's files at the next rewrite (memory.erasure)
        self.forget(fact_id)
        return record

    def delete_all(self, user_id: str) -> int:
        try:
            with self.read_repair.writing(user_id):
                ids = self.store.delete_all(user_id)
        finally:
            self.compactor.request()
        for fact_id in ids:
            self.forget(fact_id)
        self.index.clear_user(user_id)
        self.retrieval.clear_user(user_id)
        return len(ids)

    def track_version(self, record: FactRecord, vector: np.ndarray) -> None:
        """Index this version of a fact (its embedding `vector`) and queue its KV first. When it
        replaces a version the shard tracks, the old KV is dropped (never injected again) and the
        facts encoded behind the old text are re-encoded."""
        replaces = record.fact_id in self.facts
        if replaces:
            self.kv.drop_kv(record.fact_id)
        self.index.add([record.fact_id], [record.user_id], vector[None, :])
        self.retrieval.track([record])
        self.kv.track(record, urgent=True)
        if replaces:
            self.kv.reencode_dependents(record.fact_id)

    def forget(self, fact_id: str) -> None:
        """Drop a deleted fact from the index and the KV store; re-encode what was encoded behind it."""
        self.kv.forget(fact_id)
        self.kv.reencode_dependents(fact_id)
        self.index.remove([fact_id])
        self.retrieval.forget(fact_id)

    # ================================================================== reads
    def get(self, fact_id: str, user_id: str | None = None) -> StoredFact:
        return self._with_kv(self.store.get(fact_id, user_id))

    def get_all(self, user_id: str) -> list[StoredFact]:
        self.read_repair.repair(user_id)
        return [self._with_kv(record) for record in self.store.get_all(user_id)]

    def _with_kv(self, record: FactRecord) -> StoredFact:
        state = self.facts.get(record.fact_id)
        known = state is not None and state.version == record.version
        return StoredFact(**record.model_dump(), **(self.kv.status(record.fact_id) if known else {}))

    def history(self, fact_id: str, user_id: str | None = None) -> list[FactEvent]:
        return self.store.history(fact_id, user_id)

    def search(self, user_id: str, query: str, top_k: int) -> list[MemoryHit]:
        """The user's top_k facts for `query`, most similar first."""
        if top_k <= 0:
            return []
        self.read_repair.repair(user_id)
        return self.selector.search(user_id, query, top_k)

    def plan_chat(self, query: ChatQuery) -> ChatPlan:
        """The prompt for a chat: facts chosen by memory.fact_selection, laid out by
        memory.planner; the plan's `timings` say where the shard's time went (ms: shard_embed,
        shard_search, shard_compose)."""
        selection = self.selector.select(query)
        started = time.perf_counter()
        plan = plan_chat(
            layout=self.layout,
            kv=self.kv,
            query=query,
            selection=selection,
            salt_namespace=user_namespace(self.settings.redis_prefix, query.user_id),
            default_prefill_top_m=self.settings.prefill_top_m,
        )
        plan.timings = {**selection.timings, "shard_compose": (time.perf_counter() - started) * 1e3 + selection.tokenizing_ms}
        return plan

    # ================================================================== encoding
    def take_encode_jobs(self, max_jobs: int | None = None, engine_slot: int | None = None) -> list[EncodeJob]:
        """Allocate arena entries for queued facts and hand out their capture jobs to the engine in
        `engine_slot` (the encode driver polls this, so an unsure user is repaired here too, even
        if they never come back)."""
        if self.read_repair.unsure:
            self.read_repair.repair()
        self.retrieval.refresh()  # rebuild written users' keyword indexes here, off the chat path
        return self.kv.take_jobs(max_jobs or self.settings.encode_batch, self.settings.encode_batch_tokens, engine_slot or 0)

    def engine_started(self, engine_slot: int) -> int:
        """A new engine serves this shard in `engine_slot` (a replica started or replaced): the encode
        jobs its predecessor there took are retried now. Returns how many."""
        return self.kv.release_jobs_of(engine_slot)

    def complete_encode_jobs(self, outcomes: dict[str, EncodeOutcome]) -> int:
        """Commit the captured entries (job id -> memory.kv_lifecycle.EncodeOutcome: True, False, a
        failure reason, or None when the engine could not run it); returns how many went live."""
        return self.kv.complete_jobs(outcomes)

    def pending_encodes(self) -> int:
        return self.kv.pending()

    def encode_pending(self, fact_ids: Sequence[str]) -> list[str]:
        """The facts among `fact_ids` still waiting for their KV (queued or being encoded)."""
        return self.kv.pending_of(fact_ids)

    # ================================================================== accounting
    def stats(self) -> dict[str, Any]:
        usage = self.arena.usage()
        return {
            "shard": self.shard_id,
            "facts": len(self.facts),
            "facts_with_kv": len(self.kv.lru),
            "facts_encoded_total": self.kv.facts_encoded,
            "kv_evictions_total": self.kv.evictions,  # entries released for room: the arena is too small when it climbs
            "users_unsure": len(self.read_repair.unsure),  # a write of theirs failed; resynced from Redis when it answers
            "users_resynced_total": self.read_repair.resynced,
            "pending_encodes": self.pending_encodes(),
            **self.compactor.stats(),  # Redis file rewrites after deletes (memory.erasure)
            "index_vectors": len(self.index),
            **self.retrieval.stats(),  # retriever, keyword_facts, keyword_users_dirty, keyword_rebuilds_total
            "index_backend": f"{type(self.index).__name__} on {getattr(self.index, 'device', 'cpu')}",  # CagraIndex | ExactIndex
            "host_bytes_used": usage["bytes_host"],
            "host_bytes_capacity": self.arena.geometry.kv_bytes(),
            "device_bytes_used": usage["bytes_device"],  # pages the engine's HBM tier holds too
            "encode_failed": sum(1 for state in self.facts.values() if state.failed),
            "encode_failures": self.kv.failures(),  # the first ones: fact id, attempts, reason
            **usage,
            "redis_memory": self.redis_memory(),
            "shard_start_phases": self.start_phases,  # this incarnation's start (memory.start_clock)
        }

    def redis_memory(self) -> dict[str, Any]:
        """Redis's used memory against its maxmemory, with a warning (also logged) past
        memory.redis_memory_warn_fraction; at maxmemory Redis refuses writes (StoreFull)."""
        if time.monotonic() - self._redis_memory[0] < REDIS_MEMORY_EVERY_S:
            return self._redis_memory[1]
        try:
            used, limit = self.store.memory_use()  # a short timeout, no retries: never holds the shard long
        except Exception as exc:  # noqa: BLE001 - Redis away: reported, the stats still answer
            report: dict[str, Any] = {"unavailable": f"{type(exc).__name__}: {exc}"[:200]}
        else:
            report = redis_memory_report(used, limit, self.settings.redis_memory_warn_fraction)
            if "warning" in report:
                logger.warning("shard %d: %s", self.shard_id, report["warning"])
        self._redis_memory = (time.monotonic(), report)
        return report

