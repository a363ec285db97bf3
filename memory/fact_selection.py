"""Which facts a chat gets: the one place that chooses them (memory.shard calls it, memory.planner
lays the chosen facts out).

For a ChatQuery, FactSelector.select returns the user's facts, most relevant first:
- mode none: no facts;
- mode full: every fact of the user, oldest first (the order the shard tracked them in);
- modes kv and prompt: the top-k facts for the last user message (its embedding and its words,
  searched by memory.retrieval: the vector index, the keyword index, fused), never another user's
  fact, never a deleted or superseded one.
Then the least relevant are left out until [prefix][facts][conversation] fits the query's
max_prompt_tokens.

On a GPU the query's embedding runs while the conversation is tokenized (its suffix ids are
needed for the context fit anyway), so the selection's `timings` (ms) carry only the embedding
time not hidden behind that: shard_embed, shard_search, and the tokenizing, which the planner's
compose stage owns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from memory.chat_query import ChatQuery
from memory.embedder import Embedder
from memory.kv_lifecycle import FactKV
from memory.prompting import PromptLayout
from memory.records import MemoryHit
from memory.retrieval import Retriever


@dataclass
class Selection:
    """The facts chosen for a chat, most relevant first (mode full: oldest first)."""

    hits: list[MemoryHit]
    suffix_ids: list[int] | None = None  # the conversation's tokens, when selecting needed them
    timings: dict[str, float] = field(default_factory=dict)  # ms: shard_embed, shard_search
    tokenizing_ms: float = 0.0  # the conversation's tokenizing, overlapped with the embedding


class FactSelector:
    """Chooses a chat's facts from one shard's index (see the module docstring)."""

    def __init__(
        self, *, retriever: Retriever, embedder: Embedder, facts: Mapping[str, FactKV], layout: PromptLayout, default_top_k: int
    ) -> None:
        self.retriever = retriever
        self.embedder = embedder
        self.facts = facts  # fact id -> its KV state (memory.kv_lifecycle; text, user, tokens)
        self.layout = layout
        self.default_top_k = default_top_k

    def select(self, query: ChatQuery) -> Selection:
        if query.mode == "none":
            return Selection([])
        if query.mode == "full":
            hits = [MemoryHit(key, state.text, 0.0, state.source_id) for key, state in self.facts.items() if state.user_id == query.user_id]
            return self._fitted(Selection(hits), query)
        k = self.default_top_k if query.top_k is None else query.top_k
        question = query.question
        if not question or k <= 0:
            return self._fitted(Selection([]), query)
        started = time.perf_counter()
        embedding = self.embedder.start_query(question)
        launched = time.perf_counter()
        suffix = self.layout.suffix_ids(query.messages)
        tokenized = time.perf_counter()
        vector = embedding()
        embedded = time.perf_counter()
        hits = self.top_k(query.user_id, vector, k, question)
        timings = {
            "shard_embed": (launched - started + embedded - tokenized) * 1e3,
            "shard_search": (time.perf_counter() - embedded) * 1e3,
        }
        return self._fitted(Selection(hits, suffix, timings, (tokenized - launched) * 1e3), query)

    def search(self, user_id: str, text: str, k: int) -> list[MemoryHit]:
        """The user's top-k facts for `text`, most similar first (the memory search route)."""
        if k <= 0:
            return []
        return self.top_k(user_id, self.embedder.embed_query(text), k, text)

    def top_k(self, user_id: str, vector: np.ndarray, k: int, text: str = "") -> list[MemoryHit]:
        """The user's k best facts for `vector` (and `text`, for the keyword half of a hybrid
        search; without it, dense only): only facts the shard tracks for this user."""
        hits = self.retriever.search(user_id, text, vector, k)
        out = []
        for hit in hits:
            state = self.facts.get(hit.fact_id)
            if state is None or state.user_id != user_id:  # never another user's fact
                continue
            out.append(MemoryHit(hit.fact_id, state.text, float(hit.score), state.source_id))
        return out

    def _fitted(self, selection: Selection, query: ChatQuery) -> Selection:
        """The most relevant hits whose tokens fit next to the conversation in max_prompt_tokens."""
        if query.max_prompt_tokens is None or not selection.hits:
            return selection
        if selection.suffix_ids is None:
            started = time.perf_counter()
            selection.suffix_ids = self.layout.suffix_ids(query.messages)
            selection.tokenizing_ms += (time.perf_counter() - started) * 1e3
        room = query.max_prompt_tokens - len(self.layout.prefix_ids) - len(selection.suffix_ids)
        kept: list[MemoryHit] = []
        for hit in selection.hits:
            room -= len(self.facts[hit.fact_id].segment_ids)
            if room < 0:
                break
            kept.append(hit)
        selection.hits = kept
        return selection
