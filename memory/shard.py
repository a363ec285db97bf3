"""MemoryShard: the state one engine's users' memory lives in (actors.shard_actor runs it as a Ray actor).

A shard owns, for the users assigned to it:
- the durable fact records, through FactStore (Redis is the source of truth);
- the vector index over fact embeddings (memory.index: exact torch or cuVS CAGRA);
- the fact KV arena (kvarena.arena), shared with the engine's connector: the shard
  allocates, commits and releases entries (memory.kv_lifecycle); the engine captures into
  them and injects them; memory.planner composes the chat prompts.

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
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kvarena.arena import ArenaError, FactArena, arena_geometry_for
from memory.embedder import Embedder
from memory.fact_store import FactEvent, FactRecord, FactStore, NewFact, Turn
from memory.index import build_index
from memory.kv_lifecycle import PREFIX_KEY, EncodeJob, FactKV, FactKVLifecycle
from memory.planner import ChatPlan, MemoryHit, plan_chat
from memory.prompting import PromptLayout
from memory.settings import MemorySettings

logger = logging.getLogger(__name__)

__all__ = ["MemoryShard", "ChatPlan", "MemoryHit", "EncodeJob", "PREFIX_KEY"]


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
        self.kv = FactKVLifecycle(
            self.arena,
            self.layout,
            settings.instruction,
            window_of=self._window_of,
            encode_timeout_s=settings.encode_timeout_s,
            name=f"shard {shard_id}",
        )
        self.facts: dict[str, FactKV] = self.kv.facts  # fact id -> its KV state (the same dict)
        self.kv.reset_arena()
        self._rebuild()

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
            for record, _ in rows:
                self.kv.track(record)
            n += len(rows)
        logger.info("shard %d rebuilt %d facts of %d users from Redis in %.2fs", self.shard_id, n, len(users), time.perf_counter() - start)

    def _window_of(self, state: FactKV) -> list[Turn]:
        return self.store.window_before(state.user_id, state.source_id, self.settings.window_turns)

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
                self.kv.track(record)
            results.append({"id": record.fact_id, "memory": record.text, "event": "ADD" if created else "NONE"})
        return results

    def update(self, fact_id: str, user_id: str, text: str) -> FactRecord:
        """New text, new embedding, new KV; the old KV is released and never injected again."""
        embedding = self.embedder.embed([text])[0]
        record = self.store.update(fact_id, user_id, text, embedding)
        self.kv.drop_kv(fact_id)
        self.index.add([fact_id], [user_id], embedding[None, :])
        self.kv.track(record)
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
        self.kv.forget(fact_id)
        self.index.remove([fact_id])

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
        """The prompt for a chat request with the user's top-k facts (memory.planner.plan_chat)."""
        hits: list[MemoryHit] = []
        if mode != "none":
            k = self.settings.top_k if k is None else k
            query = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
            hits = self.search(user_id, query, k) if query else []
        return plan_chat(
            layout=self.layout,
            kv=self.kv,
            hits=hits,
            messages=messages,
            mode=mode,
            salt_namespace=f"{self.settings.redis_prefix}:{user_id}",
            max_prompt_tokens=max_prompt_tokens,
        )

    # ================================================================== encoding
    def take_encode_jobs(self, max_jobs: int | None = None) -> list[EncodeJob]:
        """Allocate arena entries for queued facts and hand out their capture jobs."""
        return self.kv.take_jobs(max_jobs or self.settings.encode_batch)

    def complete_encode_jobs(self, outcomes: dict[str, bool]) -> int:
        """Commit the captured entries (job id -> captured); returns how many facts went live."""
        return self.kv.complete_jobs(outcomes)

    def pending_encodes(self) -> int:
        return self.kv.pending()

    # ================================================================== accounting
    def stats(self) -> dict[str, Any]:
        usage = self.arena.usage()
        return {
            "shard": self.shard_id,
            "facts": len(self.facts),
            "facts_with_kv": len(self.kv.lru),
            "facts_encoded_total": self.kv.facts_encoded,
            "pending_encodes": self.pending_encodes(),
            "index_vectors": len(self.index),
            "host_bytes_used": usage["bytes_host"],
            "host_bytes_capacity": self.arena.geometry.kv_bytes(),
            "device_bytes_used": usage["bytes_device"],  # pages the engine's HBM tier holds too
            **usage,
        }
