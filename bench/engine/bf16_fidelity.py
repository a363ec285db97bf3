"""bf16 fidelity of KV injection on the GPU with SmolLM2-135M-Instruct's real weights (parts `equiv`
and `equiv_bi` of bench/engine/engine_ttft.py; `--fidelity` runs both and writes
OUT/bf16_fidelity_<card>.json). The comparisons it reports: docs/bench.md."""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from pathlib import Path

from bench.engine.engine_setup import capture_segments, convert_smollm2, make_engine, new_arena, rpc_drop, rpc_stats, sampling_params, tokens_prompt
from bench.kit.results import card_tag, median, read_json, write_result

SHIFT = 1000  # positions the relocated memory is moved by (and back)
TOKENS = 32


def _first_gap(a, b) -> float:
    la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
    common = set(la) & set(lb)
    return max(abs(la[t].logprob - lb[t].logprob) for t in common) if common else float("inf")


def _same(a, b) -> bool:
    return list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)


def _relocate(llm, arena, segment, filler, query: list[int]):
    """Inject `segment` at position len(filler.token_ids) behind `filler`, capture the injected range
    back out of the paged cache (keys re-rotated once), return it as a segment encoded there: serving
    it at 0 re-rotates the keys a second time."""
    from kvarena.params import EntryPlacement, KVMemoryParams
    from memory.composition import StoredSegment, compose

    shift = len(filler.token_ids)
    composed = compose([filler, segment], query, namespace=uuid.uuid4().hex)
    snapshot = arena.allocate(list(segment.token_ids), encode_start=shift)
    params = KVMemoryParams(
        inject=composed.params.inject,
        capture=EntryPlacement(entry=snapshot.entry_id, generation=snapshot.generation, start=shift),
    )
    llm.generate([tokens_prompt(composed.prompt_token_ids, composed.cache_salt)], sampling_params(1, params), use_tqdm=False)
    arena.commit(snapshot)
    return StoredSegment(snapshot, segment.token_ids)


def run(args) -> dict:
    from kvarena.arena import ArenaGeometry
    from memory.composition import compose

    batch_invariant = os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1"
    data = read_json(args.data / "locomo_tokens.json")
    started = time.perf_counter()
    model_dir = args.smollm2 or convert_smollm2(args.gguf, Path(tempfile.gettempdir()) / "smollm2-bf16")
    result: dict = {"batch_invariant": batch_invariant, "convert_s": round(time.perf_counter() - started, 1)}
    prompts = data["equiv"][: args.equiv]
    filler_ids = [t for p in prompts for t in p["memory"]][:SHIFT]
    pages = 3 * sum(-(-(len(p["memory"]) + len(p["query"])) // 16) for p in prompts) + SHIFT // 16 + 16
    geometry = ArenaGeometry(num_layers=30, num_kv_heads=3, head_size=64, dtype="bfloat16", page_tokens=16,
                             num_pages=pages, max_entries=3 * len(prompts) + 8, max_pages_per_entry=128)
    arena = new_arena(geometry, "smol")
    started = time.perf_counter()
    llm = make_engine(model_dir, arena.path, device_pages=geometry.num_pages, gpu_mem=0.30, max_len=4096, enforce_eager=args.eager)
    result["engine_start_s"] = round(time.perf_counter() - started, 1)
    segments = capture_segments(llm, arena, [(p["memory"], 0, len(p["memory"])) for p in prompts])
    (filler,) = capture_segments(llm, arena, [(filler_ids, 0, len(filler_ids))])

    def run(ids, params=None, salt=None):
        (o,) = llm.generate([tokens_prompt(ids, salt)], sampling_params(TOKENS, params, logprobs=5), use_tqdm=False)
        return o

    composed_all = [compose([segment], p["query"], namespace=uuid.uuid4().hex) for p, segment in zip(prompts, segments)]
    rows, plain_s, hbm_s = [], [], []
    for p, composed in zip(prompts, composed_all):  # memory resident in the HBM tier (promoted at capture)
        t0 = time.perf_counter()
        plain = run(composed.prompt_token_ids, None, uuid.uuid4().hex)
        t1 = time.perf_counter()
        hbm = run(composed.prompt_token_ids, composed.params, composed.cache_salt)
        t2 = time.perf_counter()
        plain_s.append(t1 - t0)
        hbm_s.append(t2 - t1)
        rows.append({"memory_tokens": len(p["memory"]), "injected_hbm": hbm.num_cached_tokens, "plain": plain, "hbm": hbm})
    try:
        relocated = [_relocate(llm, arena, segment, filler, p["query"]) for p, segment in zip(prompts, segments)]
    except Exception as exc:  # noqa: BLE001 - recorded; the other comparisons stand
        result["relocated_error"] = repr(exc)[-1000:]
        relocated = []
    for i, (row, composed) in enumerate(zip(rows, composed_all)):  # then from the host tier: HBM tier emptied before each
        llm.collective_rpc(rpc_drop)
        host = run(composed.prompt_token_ids, composed.params, uuid.uuid4().hex)  # fresh salt: no reuse
        plain, hbm = row.pop("plain"), row.pop("hbm")
        salt = uuid.uuid4().hex
        cold = run(composed.prompt_token_ids, None, salt)
        warm = run(composed.prompt_token_ids, None, salt)
        row.update(
            injected_host=host.num_cached_tokens,
            identical_hbm=_same(hbm, plain),
            identical_host=_same(host, plain),
            gap_hbm=_first_gap(plain, hbm),
            gap_host=_first_gap(plain, host),
            identical_cold_vs_plain=_same(cold, plain),
            identical_prefix_cached_vs_cold=_same(warm, cold),
            gap_prefix_cached=_first_gap(cold, warm),
            prefix_cached_tokens=warm.num_cached_tokens,
            identical_hbm_vs_prefix_cached=_same(hbm, warm),
            gap_hbm_vs_prefix_cached=_first_gap(warm, hbm),
        )
        if relocated:
            moved = compose([relocated[i]], prompts[i]["query"], namespace=uuid.uuid4().hex)
            out = run(moved.prompt_token_ids, moved.params, moved.cache_salt)
            row.update(injected_relocated=out.num_cached_tokens, identical_relocated=_same(out, plain),
                       gap_relocated=_first_gap(plain, out), identical_relocated_vs_hbm=_same(out, hbm))
    batch = [tokens_prompt(c.prompt_token_ids, uuid.uuid4().hex) for c in composed_all]
    t0 = time.perf_counter()
    llm.generate(batch, sampling_params(TOKENS), use_tqdm=False)
    batch_plain_s = time.perf_counter() - t0
    n = len(rows)

    def share(key: str) -> float:
        return sum(r[key] for r in rows) / n

    result.update(
        prompts=n,
        mean_memory_tokens=sum(r["memory_tokens"] for r in rows) / n,
        injected_all=all(r["injected_hbm"] == r["memory_tokens"] == r["injected_host"] for r in rows),
        identical_share_hbm=share("identical_hbm"),
        identical_share_host=share("identical_host"),
        max_first_token_logprob_gap_hbm=max(r["gap_hbm"] for r in rows),
        max_first_token_logprob_gap_host=max(r["gap_host"] for r in rows),
        identical_share_hbm_vs_prefix_cached=share("identical_hbm_vs_prefix_cached"),
        max_gap_hbm_vs_prefix_cached=max(r["gap_hbm_vs_prefix_cached"] for r in rows),
        control_identical_share_prefix_cached=share("identical_prefix_cached_vs_cold"),
        control_identical_share_cold_vs_plain=share("identical_cold_vs_plain"),
        control_max_gap_prefix_cached=max(r["gap_prefix_cached"] for r in rows),
        speed={
            "plain_request_ms_median": median(plain_s, 1e3, 2),
            "injected_request_ms_median": median(hbm_s, 1e3, 2),
            f"plain_batch_of_{n}_s": round(batch_plain_s, 3),
            "tokens_per_request": TOKENS,
        },
        stats=llm.collective_rpc(rpc_stats)[0],
        rows=rows,
    )
    if relocated:
        result.update(
            relocation_shift=SHIFT,
            injected_all_relocated=all(r["injected_relocated"] == r["memory_tokens"] for r in rows),
            identical_share_relocated=share("identical_relocated"),
            identical_share_relocated_vs_hbm=share("identical_relocated_vs_hbm"),
            max_first_token_logprob_gap_relocated=max(r["gap_relocated"] for r in rows),
        )
    print({k: v for k, v in result.items() if k not in ("rows", "stats")}, flush=True)
    return result



SUMMARY_KEYS = ("identical_share_hbm", "identical_share_host", "max_first_token_logprob_gap_hbm", "identical_share_hbm_vs_prefix_cached",
                "max_gap_hbm_vs_prefix_cached", "control_identical_share_prefix_cached", "control_max_gap_prefix_cached",
                "identical_share_relocated", "identical_share_relocated_vs_hbm", "max_first_token_logprob_gap_relocated", "speed",
                "injected_all", "injected_all_relocated", "relocated_error", "error", "prompts")


def summary(out: Path) -> None:
    """Parts equiv and equiv_bi side by side: OUT/bf16_fidelity_<card>.json (the per-prompt rows
    stay in OUT/part_*.json)."""
    result: dict = {"where": "bench/engine/engine_ttft.py --fidelity", "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for part, name in (("equiv", "default"), ("equiv_bi", "batch_invariant")):
        found = read_json(out / f"part_{part}.json", {"error": "no result"})
        result.setdefault("card", found.get("card"))
        result[name] = {k: found[k] for k in SUMMARY_KEYS if k in found}
    write_result(out / f"bf16_fidelity_{card_tag(result['card'] or None)}.json", result)
