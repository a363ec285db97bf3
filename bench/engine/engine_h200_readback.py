"""Where the bf16 disagreement between KV injection and a cold prefill comes from (part `equiv` of
bench/engine/engine_h200.py, SmolLM2 on the GPU): two checks on the same 50 prompts.

1. Read back: capture the first c tokens' KV out of a cold prefill of the whole prompt
   [memory][query] (a fresh cache salt, so vLLM computes every token) and compare it bit for bit
   with the memory's KV as injected (captured from a prefill of the memory alone). Equal bits mean
   the injected KV is exactly what a cold prefill puts in the paged cache; what then differs is
   only how the query's attention is summed over it.
2. Same split: vLLM's own prefix cache serves the prompt's first c tokens (c = the cached tokens
   of the warm run, whole 16-token blocks) and computes the rest. Injecting those same c tokens'
   KV (captured above) and computing the same rest is the same attention path with the same split.
   Identical continuations there (100% expected with `VLLM_BATCH_INVARIANT=1`) say the connector
   adds nothing of its own; the warm-vs-cold share is then vLLM's cached-prefix attention path
   against its single-pass one, which KV injection inherits.
"""

from __future__ import annotations

import uuid
from typing import Callable

from bench.engine.engine_h200_common import capture_segments


def _entry_kv(arena, segment):
    view = arena.pin(segment.ref.entry_id, segment.ref.generation)
    try:
        return arena.entry_kv(view)
    finally:
        arena.unpin(segment.ref.entry_id, segment.ref.generation)


def split_checks(llm, arena, prompts: list[dict], segments: list, cold_warm: list[tuple], run: Callable,
                 same: Callable, gap: Callable) -> dict:
    """prompts[i] = {"memory", "query"}; segments[i] = the memory's injected entry; cold_warm[i] =
    (cold, warm) RequestOutputs of vLLM's prefix-cache control; run(ids, params, salt) -> output."""
    from memory.composition import compose

    fulls = [list(p["memory"]) + list(p["query"]) for p in prompts]
    splits = [warm.num_cached_tokens for _cold, warm in cold_warm]
    jobs = [(full, 0, c) for full, c in zip(fulls, splits) if c > 0]
    captured = iter(capture_segments(llm, arena, jobs, salt=uuid.uuid4().hex))
    rows = []
    for p, full, c, segment, (cold, warm) in zip(prompts, fulls, splits, segments, cold_warm):
        if c == 0:
            continue
        from_full = next(captured)
        n = min(c, len(p["memory"]))
        injected = _entry_kv(arena, segment)[:, :n].float()
        recomputed = _entry_kv(arena, from_full)[:, :n].float()
        composed = compose([from_full], full[c:], namespace=uuid.uuid4().hex)
        out = run(composed.prompt_token_ids, composed.params, composed.cache_salt)
        rows.append({
            "split": c,
            "memory_tokens": len(p["memory"]),
            "kv_bits_equal": bool(injected.equal(recomputed)),
            "kv_max_abs_diff": float((injected - recomputed).abs().max()),
            "injected_tokens": out.num_cached_tokens,
            "identical_split_injection_vs_prefix_cached": same(out, warm),
            "gap_split_injection_vs_prefix_cached": gap(warm, out),
            "identical_split_injection_vs_cold": same(out, cold),
        })
    n = max(len(rows), 1)
    return {
        "prompts": len(rows),
        "kv_bits_equal_share": sum(r["kv_bits_equal"] for r in rows) / n,
        "kv_max_abs_diff": max((r["kv_max_abs_diff"] for r in rows), default=None),
        "split_injection_identical_to_prefix_cached": sum(r["identical_split_injection_vs_prefix_cached"] for r in rows) / n,
        "split_injection_max_gap_vs_prefix_cached": max((r["gap_split_injection_vs_prefix_cached"] for r in rows), default=None),
        "split_injection_identical_to_cold": sum(r["identical_split_injection_vs_cold"] for r in rows) / n,
        "rows": rows,
    }
