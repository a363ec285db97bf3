"""Memory shard configuration (pydantic; part of the service settings read from YAML and env).

Settings only: it imports no implementation (the quota, retrieval and index modules import their
settings from here and from memory.index.settings), so reading the configuration loads none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from memory.index.settings import IndexSettings

DEFAULT_INSTRUCTION = (
    "You are a helpful assistant with a long-term memory of the user. "
    "Facts you remember about the user, most relevant last:\n"
)


class QuotaSettings(BaseModel):
    """What one user may keep; a write past a limit is refused whole (HTTP 429). 0: no limit."""

    model_config = ConfigDict(extra="forbid")

    max_facts: int = Field(10_000, ge=0, description="Most live facts one user may keep (0: no limit).")
    max_turns: int = Field(20_000, ge=0, description="Most conversation turns one user may keep (0: no limit).")
    max_text_bytes: int = Field(
        16 * 2**20,
        ge=0,
        description="Most UTF-8 bytes of stored text (fact texts plus turn texts) one user may keep (0: no limit).",
    )


class RetrievalSettings(BaseModel):
    """How a shard ranks a user's facts for a query (search and chat alike)."""

    model_config = ConfigDict(extra="forbid")

    retriever: Literal["dense", "keyword", "hybrid"] = Field(
        "hybrid",
        description="dense: the vector index alone (as before issue 29); keyword: BM25 alone; hybrid: both, fused by "
        "weighted reciprocal rank. LoCoMo evidence recall@10 (docs/retrieval.md): dense 0.609, hybrid 0.67.",
    )
    candidates: int = Field(50, gt=0, le=1000, description="Facts each retriever contributes to the fusion (at least k).")
    rrf_k: float = Field(10.0, gt=0, description="Reciprocal-rank constant: a fact at rank r of a list scores w / (rrf_k + r).")
    dense_weight: float = Field(1.0, ge=0, description="Weight of the dense list in the fusion.")
    keyword_weight: float = Field(1.0, ge=0, description="Weight of the keyword (BM25) list in the fusion.")
    time_keyword_boost: float = Field(
        1.0, ge=0, description="Keyword weight multiplier for a time question (when ..., a month or year named)."
    )
    session_dates: bool = Field(True, description="Write each fact's session date into its keyword document.")
    turn_context: bool = Field(True, description="Write each fact's source turn text (if recorded) into its keyword document.")
    stemmer: str | None = Field("english", description="Snowball stemmer language of the keyword index (PyStemmer); null: none.")
    expand: Literal["none", "turn", "session"] = Field(
        "none",
        description="After fusion, put other facts of the same source turn (turn) or session (session) right after "
        "each of the `expand_top` strongest hits, within k. Measured on LoCoMo: it does not raise evidence recall.",
    )
    expand_top: int = Field(2, ge=0, description="Strongest hits whose neighbours are added (expand).")
    expand_per_hit: int = Field(1, ge=0, description="Most neighbours added per hit (expand).")
    rerank: Literal["none", "turn_diverse"] = Field(
        "turn_diverse",
        description="Second stage over the first stage's top `candidates`: turn_diverse puts one fact per source turn "
        "first (a fact of a turn already brought by a better-ranked fact moves behind the others); none keeps the "
        "first stage's order. LoCoMo evidence recall@10 (docs/retrieval.md): +0.002 overall, +0.009 multi-hop; "
        "cost about 0.02 ms per search (used on search and chat alike).",
    )


class ArenaCapacity(BaseModel):
    """Bounds of one shard's fact KV arena (host tier; the GPU tier holds a subset of its pages)."""

    model_config = ConfigDict(extra="forbid")

    page_tokens: int = Field(16, gt=0, description="Tokens per arena page (allocation granularity).")
    num_pages: int = Field(4096, gt=0, description="Host-tier pages: the most fact tokens the shard keeps KV for.")
    max_entries: int = Field(8192, gt=0, description="Most facts (plus the instruction prefix) with KV at once.")
    max_pages_per_entry: int = Field(16, gt=0, description="Longest entry, in pages.")
    device_pages: int | Literal["auto"] = Field(
        "auto",
        description="GPU-tier (HBM) pages of fact KV in the engine process; 0 keeps fact KV in host memory only. auto: "
        "what the replica's memory plan leaves on the card, up to num_pages (0 for CPU engines); a number wins and is "
        "checked against the card.",
    )

    @field_validator("device_pages")
    @classmethod
    def _pages_not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("device_pages must be >= 0 or auto")
        return value


class ErasureSettings(BaseModel):
    """How deleted text leaves Redis's files (memory.erasure): coalesced, rate-limited rewrites."""

    model_config = ConfigDict(extra="forbid")

    compact_redis: bool = Field(
        True, description="Rewrite Redis's append-only file (and RDB snapshot) after deletes, so deleted text leaves its disk."
    )
    rewrite_delay_s: float = Field(
        2.0, ge=0, description="Seconds a rewrite waits after the first delete owing one, so a burst of deletes shares it."
    )
    rewrite_min_interval_s: float = Field(
        60.0, ge=0, description="Least seconds between two rewrites of one shard (a rewrite copies the whole dataset)."
    )
    rewrite_rdb: bool = Field(
        True, description="Also BGSAVE after the AOF rewrite when Redis keeps RDB snapshots (its `save` setting not empty)."
    )
    rewrite_timeout_s: float = Field(600.0, gt=0, description="Longest wait for one Redis rewrite or save to finish before it is retried.")
    poll_s: float = Field(0.1, gt=0, description="Seconds between checks of whether Redis finished a rewrite.")


class MemorySettings(BaseModel):
    """How each shard stores, encodes and retrieves a user's memory."""

    model_config = ConfigDict(extra="forbid")

    window_turns: int = Field(
        0,
        ge=0,
        description="Conversation turns before a fact's source turn encoded with it (w). 0: a fact is encoded behind "
        "its neighbours only. On LoCoMo (H200, 4 conversations, k = 10, n = 6) w = 5 cost KV injection 0.8 F1 points "
        "overall and 3.2 on multi-hop against w = 0, and raised its list-like answers from 0% to 2% (docs/quality.md).",
    )
    max_facts_per_turn: int = Field(5, gt=0, description="Most facts extraction keeps from one turn.")
    encode_neighbours: int = Field(
        6,
        ge=0,
        le=32,
        description="The user's facts closest to a fact (by embedding) that it is encoded behind, after its window if any "
        "(memory.prompting): it becomes a later item of a fact list at encode time, as at serving time, and attends "
        "to the facts most likely retrieved with it. Updating or deleting a fact re-encodes the facts encoded behind it. "
        "0 encodes each fact alone (behind its window only): on LoCoMo that left 73% of KV answers starting like a "
        "list item; 6 brings it to 0.3% (docs/quality.md). Each one lengthens every encode prompt by a fact: the CPU "
        "config.yaml uses 3.",
    )
    top_k: int = Field(10, ge=0, description="Facts retrieved per chat request unless the request says otherwise.")
    reconcile: bool = Field(
        True,
        description="On an add from messages (infer), reconcile each extracted fact with the user's closest facts: the "
        "served model decides ADD, UPDATE, DELETE or NONE (serve_app.replica.reconciliation); a request's `reconcile` overrides it.",
    )
    reconcile_top_k: int = Field(
        1,
        gt=0,
        le=20,
        description="Most existing facts shown to the model per extracted fact (the closest ones above reconcile_min_score). "
        "1 for SmolLM2-135M, which named the second of any two (bench/results/reconcile_cpu.json); raise it for a "
        "model that chooses among several, as Mem0 shows its LLM the top facts.",
    )
    reconcile_min_score: float = Field(
        0.3,
        ge=-1.0,
        le=1.0,
        description="Least embedding similarity between an extracted fact and an existing fact for the model to update "
        "or delete it; a proposal below it is an ADD (a small model proposes changes to unrelated facts).",
    )
    instruction: str = Field(DEFAULT_INSTRUCTION, description="System text before the facts (captured once, injected).")
    prefill_top_m: int = Field(
        0,
        ge=0,
        description="Mode kv: the m most relevant retrieved facts are prefilled as text after the injected ones, so they "
        "attend to every other fact (each injected fact was encoded alone); a request's memory.prefill_top_m overrides.",
    )
    memory_closing: str = Field(
        "",
        description="Text right after the facts in every served prompt (prefilled, so it attends to all of them), "
        "e.g. a line that closes the fact list before the conversation.",
    )
    window_bridge: str = Field(
        "",
        description="Text between a fact's window and the fact in its encode prompt (memory.prompting): it hands "
        "back from the conversation to the fact list. Changing it changes only facts encoded afterwards.",
    )
    redis_prefix: str = Field("kvmem", description="Prefix of every Redis key this service writes.")
    redis_timeout_s: float = Field(
        2.0,
        gt=0,
        description="Most seconds one Redis call of the shard waits (socket and connect timeout): while Redis is away "
        "a write fails fast with 503 and Retry-After, instead of holding the shard's later calls behind it.",
    )
    quota: QuotaSettings = Field(
        default_factory=QuotaSettings,
        description="Per-user quotas (memory.quota): facts, turns and bytes of stored text; a write past one is refused "
        "whole with 429 quota_exceeded.",
    )
    redis_memory_warn_fraction: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Past this fraction of Redis's maxmemory the shards log a warning, and /health and /v1/shards carry "
        "one (`redis_memory`); at maxmemory Redis (policy noeviction) refuses writes: 507 memory_store_full.",
    )
    arena_dir: str = Field("/dev/shm", description="Folder for the shared-memory KV arenas (one per shard).")
    arena: ArenaCapacity = Field(default_factory=ArenaCapacity)
    erasure: ErasureSettings = Field(default_factory=ErasureSettings, description="Redis file rewrites after deletes.")
    index: IndexSettings = Field(default_factory=IndexSettings)
    retrieval: RetrievalSettings = Field(
        default_factory=RetrievalSettings, description="How facts are ranked: dense, keyword (BM25) or both (memory.retrieval)."
    )
    embedding_model: str | None = Field(None, description="sentence-transformers folder; default all-MiniLM-L6-v2.")
    embedding_device: str = Field("auto", description="Device of the embedding model: auto (cuda when the shard has a GPU), cpu, cuda.")
    encode_batch: int = Field(32, gt=0, description="Most encode (capture) requests sent to the engine at once.")
    encode_batch_tokens: int = Field(
        4096,
        gt=0,
        description="Most prompt tokens (window + fact) of one encode batch, so a batch of turn-by-turn adds finishes "
        "well within encode_request_timeout_s on a CPU engine; raise it on GPUs.",
    )
    encode_timeout_s: float = Field(
        300.0, gt=0, description="An encode job not reported back by then (its replica died) is released and retried."
    )
    encode_context_tokens: int = Field(
        4096,
        gt=1,
        description="The engine's context length: an encode prompt [prefix][window][fact] plus its one generated token "
        "fits in it (the window is trimmed, oldest turns first). The LLM replica sets it to engine.max_model_len.",
    )
    max_encode_attempts: int = Field(
        3,
        gt=0,
        description="Failed encodes of one fact before the shard stops retrying it: the fact is then served as text, "
        "with the reason in its record and in the shard's stats. An engine that died does not count as an attempt.",
    )
    encode_request_timeout_s: float = Field(
        120.0, gt=0, description="Most seconds one batch of encode requests may run in the engine before it is aborted."
    )
    max_pending_encodes_per_user: int = Field(
        64,
        ge=0,
        description="Most of one user's facts waiting for their KV (queued or being encoded); an add that would pass it "
        "is answered 429 with Retry-After and stores nothing, so one user's flood of adds cannot build a backlog that "
        "slows every other user's chats and encodes. 0: no bound.",
    )
    arena_floor_entries_per_user: int = Field(
        32,
        ge=0,
        description="Each user's most recently used fact KV entries (up to this many) that other users' facts cannot "
        "evict from the arena (memory.fairness.FloorLRU); only the user's own new facts replace them. 0: one plain LRU.",
    )
    encode_share_while_chatting: float = Field(
        0.25,
        gt=0,
        le=1,
        description="While chats are running on the replica, the background encoder uses at most this share of the "
        "time (it pauses after each batch for (1 - share) / share of the batch's time), so chats are not slowed by "
        "encodes and encodes are not starved by chats. 1: encodes never pause.",
    )
    encode_batch_while_chatting: int = Field(
        1, gt=0, description="Most encode requests of one background batch while chats are running (encode_batch otherwise)."
    )
    encode_gap_wait_s: float = Field(
        0.0,
        ge=0,
        le=10,
        description="While chats are being served, the background encoder starts a batch only when no chat is running at "
        "that moment, waiting at most this long (then it starts anyway). Worth it where an encode beside a chat slows "
        "the chat (the CPU engine: config.yaml sets 2; docs/hostile.md); under constant chat load each batch waits the "
        "whole bound, so the encodes slow down. 0: no wait (GPUs batch an encode with the chats at little cost).",
    )
    add_encode_wait_s: float = Field(
        30.0,
        ge=0,
        description="Most seconds an add or update that asks for it (wait_for_kv) waits for its facts' KV before "
        "answering; the facts are stored and acknowledged either way, and their KV follows in the background "
        "(prefilled as text until then).",
    )

    def arena_path(self, namespace: str, shard_id: int) -> Path:
        """Where shard `shard_id` of `namespace` keeps its arena (its engine opens it there)."""
        return Path(self.arena_dir) / f"kvmem-{namespace}-shard{shard_id}"
