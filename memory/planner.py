"""The chat planner: turns retrieved facts and a conversation into the prompt an engine runs.

A plan is [instruction prefix][facts, least relevant first][conversation + generation prompt]
(memory.composition). In mode "kv" the facts with live KV (and the prefix) are injected by the
connector and the rest are prefilled as text right after them; mode "prompt" prefills the same
token ids (Mem0-style prompt injection); mode "full" prefills every fact of the user, oldest
first, with no retrieval (a prefix that stays the same across the user's requests, so vLLM's
prefix cache computes it once); mode "none" is the plain conversation. No Ray, no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memory.chat_query import ChatQuery, MemoryMode
from memory.composition import StoredSegment, compose, scope_cache_salt
from memory.fact_selection import Selection
from memory.kv_lifecycle import FactKVLifecycle
from memory.prompting import PromptLayout
from memory.records import MemoryHit


@dataclass
class ChatPlan:
    """A memory-conditioned prompt: token ids, and what to hand the engine for KV injection."""

    prompt_token_ids: list[int]
    mode: MemoryMode
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    facts: list[MemoryHit] = field(default_factory=list)
    injected_tokens: int = 0  # tokens the connector will supply (prefix + facts with KV)
    prefilled_fact_ids: list[str] = field(default_factory=list)  # retrieved but without KV yet
    timings: dict[str, float] = field(default_factory=dict)  # ms per planning stage (shard_embed, ...)


def plan_chat(
    *,
    layout: PromptLayout,
    kv: FactKVLifecycle,
    query: ChatQuery,
    selection: Selection,
    salt_namespace: str,
    default_prefill_top_m: int = 0,
) -> ChatPlan:
    """The plan for `query` conditioned on the facts memory.fact_selection chose for it (most
    relevant first, already fitted to the query's max_prompt_tokens; mode full: every fact,
    oldest first); see the module docstring.

    salt_namespace names the user whose requests alone may share the prompt's cached blocks
    (every mode is salted). prefill_top_m (mode kv; the query's, else `default_prefill_top_m`):
    the m most relevant facts are prefilled as text after the injected ones even when their KV is
    live, so they attend to every other fact (the cross-fact repair: injected facts were each
    encoded without the others).
    """
    mode, messages, hits = query.mode, query.messages, selection.hits
    prefill_top_m = default_prefill_top_m if query.prefill_top_m is None else query.prefill_top_m
    if mode == "none":
        return ChatPlan(prompt_token_ids=layout.plain_prompt_ids(messages), mode=mode, cache_salt=scope_cache_salt(salt_namespace))
    suffix = layout.suffix_ids(messages) if selection.suffix_ids is None else selection.suffix_ids
    # least relevant first, most relevant next to the query; mode full: as given (oldest first, so
    # the facts that fit are the oldest and a new fact only extends the cached prefix)
    ordered = list(hits) if mode == "full" else list(reversed(hits))
    if mode in ("prompt", "full") or kv.prefix.ref is None:
        tokens = list(layout.prefix_ids)
        for hit in ordered:  # each fact's token ids, tokenized once when it was stored (the kv path's own)
            tokens += kv.facts[hit.fact_id].segment_ids
        return ChatPlan(
            prompt_token_ids=tokens + suffix,
            mode="full" if mode == "full" else "prompt",
            facts=[] if mode == "full" else hits,  # full: nothing retrieved (ids of the whole memory stay home)
            cache_salt=scope_cache_salt(salt_namespace),
        )
    segments = [StoredSegment(kv.prefix.ref, kv.prefix.segment_ids)]
    pending: list[int] = []
    pending_ids: list[str] = []
    in_context = {hit.fact_id for hit in hits[:prefill_top_m]}  # the most relevant m (hits: most relevant first)
    for hit in ordered:
        state = kv.use(hit.fact_id)
        if state.ref is not None and hit.fact_id not in in_context:
            segments.append(StoredSegment(state.ref, state.segment_ids))
        else:  # without KV yet (or evicted, failed), or one of the m prefilled on purpose
            pending += state.segment_ids
            if state.ref is None:
                pending_ids.append(hit.fact_id)
    composed = compose(segments, pending + suffix, namespace=salt_namespace)
    return ChatPlan(
        prompt_token_ids=composed.prompt_token_ids,
        mode="kv",
        kv_transfer_params=composed.kv_transfer_params(),
        cache_salt=composed.cache_salt,
        facts=hits,
        injected_tokens=composed.memory_end,
        prefilled_fact_ids=pending_ids,
    )
