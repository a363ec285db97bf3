"""Two parts of the engine benchmark (bench/engine/engine_h200.py describes them): smoke and
engine8b (equiv: bench/engine/engine_h200_equiv.py). Each takes the parsed arguments and returns its JSON-able result."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.engine.engine_h200_common import (
    REPO,
    capture_segments,
    make_engine,
    median_ms,
    new_arena,
    rpc_drop,
    rpc_stats,
    sampling_params,
    tokens_prompt,
    write_json,
)


def part_smoke(args) -> dict:
    import torch

    result: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    try:
        import triton
        import vllm

        result.update(triton=triton.__version__, vllm=vllm.__version__)
    except Exception as exc:  # noqa: BLE001
        result["import_error"] = repr(exc)
    test = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--noconftest", "tests/test_triton_inject.py", "tests/test_gpu_tiers.py"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    result["kernel_tests"] = {"rc": test.returncode, "tail": test.stdout[-1500:] + test.stderr[-1500:]}
    print(test.stdout[-800:], flush=True)

    from triton.testing import do_bench

    from connector import triton_inject as ti
    from connector.host_pinning import pin_host_tensor

    layers, heads, head, tokens, block = 32, 8, 128, 1024, 16
    dev = torch.device("cuda")
    caches = [torch.randn(4096, 2, block, heads, head, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    cache_ref = ti.PagedCacheRef(caches)
    rows_total = 8192
    src = torch.randn(layers, rows_total, 2, heads, head, dtype=torch.bfloat16, device=dev)
    rows = torch.randperm(rows_total, device=dev)[:tokens]
    slots = torch.randperm(4096 * block, device=dev)[:tokens]
    dist = torch.randint(0, 2000, (tokens,), device=dev)
    cos = torch.randn(131072, 64, device=dev)
    sin = torch.randn(131072, 64, device=dev)
    moved = 2 * layers * tokens * 2 * heads * head * 2  # read + write, bytes
    t_inject = do_bench(lambda: ti.inject(cache_ref, src, rows, slots, dist, cos, sin, head, True), warmup=50, rep=300, return_mode="median")
    host = src.cpu().contiguous()
    mapped = pin_host_tensor(host, dev)
    staging = torch.empty(layers, tokens, 2, heads, head, dtype=torch.bfloat16, device=dev)
    stage_rows = torch.arange(tokens, device=dev)
    host_bytes = layers * tokens * 2 * heads * head * 2
    micro = {"tokens": tokens, "layers": layers, "inject_hbm_ms": round(t_inject, 4), "inject_hbm_GBps": round(moved / t_inject / 1e6, 1)}
    if mapped is not None:
        t_copy = do_bench(lambda: ti.copy_rows(mapped, rows, staging, stage_rows), warmup=20, rep=300, return_mode="median")
        micro.update(host_rows_ms=round(t_copy, 4), host_rows_GBps=round(host_bytes / t_copy / 1e6, 1))
    else:
        micro["host_rows"] = "pinning failed"
    pinned = torch.empty(host_bytes // 2, dtype=torch.bfloat16).pin_memory()
    flat = torch.empty(host_bytes // 2, dtype=torch.bfloat16, device=dev)
    t_dma = do_bench(lambda: flat.copy_(pinned, non_blocking=True), warmup=20, rep=300, return_mode="median")
    micro.update(dma_same_bytes_ms=round(t_dma, 4), dma_GBps=round(host_bytes / t_dma / 1e6, 1))
    # host time of one launch (Python + driver), what each injecting step pays per kernel call
    def launch_us(fn, n: int = 200) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - started
        torch.cuda.synchronize()
        return round(elapsed / n * 1e6, 1)

    small = rows[:64], slots[:64], dist[:64]
    micro["launch_host_us"] = {
        "inject": launch_us(lambda: ti.inject(cache_ref, src, *small, cos, sin, head, True)),
        "inject_4_layers": launch_us(lambda: ti.inject(cache_ref, src, *small, cos, sin, head, True, 4, 4)),
        "copy_rows": launch_us(lambda: ti.copy_rows(src, small[0], staging, stage_rows[:64])),
        "torch_index_copy": launch_us(lambda: staging[0].index_copy_(0, stage_rows[:64], src[0].index_select(0, small[0]))),
    }
    result["micro"] = micro
    print("micro:", micro, flush=True)
    return result


def part_engine8b(args) -> dict:
    import random

    import numpy as np

    from memory.composition import compose
    from kvarena.arena import ArenaGeometry

    data = json.loads((args.data / "locomo_tokens.json").read_text())
    rng = random.Random(1)
    model_dir = Path(tempfile.mkdtemp(prefix="engine-model-"))
    config = json.loads(args.model_config.read_text())
    (model_dir / "config.json").write_text(json.dumps(config))
    pool_facts = rng.sample(data["facts"], args.pool)
    pages = sum(-(-len(f) // 16) for f in pool_facts) + -(-len(data["prefix"]) // 16)
    geometry = ArenaGeometry(
        num_layers=config["num_hidden_layers"], num_kv_heads=config["num_key_value_heads"],
        head_size=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"], dtype="bfloat16",
        page_tokens=16, num_pages=pages + 64, max_entries=args.pool + 64, max_pages_per_entry=16,
    )  # fmt: skip
    arena = new_arena(geometry, "8b")
    result: dict = {"arena": {"pages": geometry.num_pages, "GiB": round(geometry.kv_bytes() / 2**30, 2), "pool_facts": args.pool}}
    result["block_size"] = args.block_size or 16
    out = args.out / "part_engine8b.json"
    started = time.perf_counter()
    llm = make_engine(model_dir, arena.path, device_pages=geometry.num_pages, gpu_mem=0.80, max_len=8192, enforce_eager=args.eager, block_size=args.block_size)
    result["engine_start_s"] = round(time.perf_counter() - started, 1)
    print(f"engine up in {result['engine_start_s']} s", flush=True)

    started = time.perf_counter()
    prefix_seg = capture_segments(llm, arena, [(data["prefix"], 0, len(data["prefix"]))])[0]
    pool = capture_segments(llm, arena, [(f, 0, len(f)) for f in pool_facts])
    result["capture_s"] = round(time.perf_counter() - started, 2)
    result["stats_after_capture"] = llm.collective_rpc(rpc_stats)[0]
    result["usage_after_capture"] = arena.usage()
    print("captured", len(pool), "facts;", result["stats_after_capture"], flush=True)
    queries = data["queries"]

    def request(mode: str, k: int, query: list[int]):
        if mode == "none":
            return list(data["prefix"]) + query, None, None, 0, []
        chosen = rng.sample(pool, k)
        composed = compose([prefix_seg, *chosen], query, namespace=uuid.uuid4().hex)
        entries = [prefix_seg.ref.entry_id, *(c.ref.entry_id for c in chosen)]
        if mode == "prompt":
            return composed.prompt_token_ids, None, None, composed.memory_end, entries
        return composed.prompt_token_ids, composed.params, composed.cache_salt, composed.memory_end, entries

    def ttft_one(mode: str, k: int, query: list[int]) -> tuple[float, int, int]:
        ids, params, salt, memory_end, entries = request(mode, k, query)
        if mode == "kv_host":  # this request's entries leave the HBM tier: read from host memory
            llm.collective_rpc(rpc_drop, args=(entries,))
        sp = sampling_params(1, params)
        start = time.perf_counter()
        (o,) = llm.generate([tokens_prompt(ids, salt)], sp, use_tqdm=False)
        seconds = time.perf_counter() - start
        report = (getattr(o, "kv_transfer_params", None) or {}).get("kvmem") or {}
        scheduler_us[(k, mode)].append(float(report.get("scheduler_us", 0.0)))
        return seconds, o.num_cached_tokens or 0, memory_end

    def warm_pool() -> None:
        """Inject every pool fact once, so that all are resident in the HBM tier again."""
        order = list(range(len(pool)))
        rng.shuffle(order)
        for start in range(0, len(order), 50):
            chosen = [pool[i] for i in order[start : start + 50]]
            composed = compose([prefix_seg, *chosen], queries[0], namespace=uuid.uuid4().hex)
            llm.generate([tokens_prompt(composed.prompt_token_ids, composed.cache_salt)], sampling_params(1, composed.params), use_tqdm=False)

    # Every round measures each (k, mode) once, in a fresh random order, so that drift of the
    # machine touches all cells alike. kv_host demotes only its own request's entries first
    # (they are promoted again by the request), so the pool stays resident for kv_hbm.
    modes = ("none", "prompt", "kv_hbm", "kv_host")
    cells = [(k, m) for k in args.k for m in modes]
    times: dict = {cell: [] for cell in cells}
    scheduler_us: dict = {cell: [] for cell in cells}  # connector scheduler-side host time per request
    steps_before = llm.collective_rpc(rpc_stats)[0]
    bad: dict = {cell: 0 for cell in cells}
    qi = 0
    for round_ in range(args.requests + args.warmup):
        rng.shuffle(cells)
        for k, mode in cells:
            seconds, cached, memory_end = ttft_one(mode, k, queries[qi % len(queries)])
            qi += 1
            if mode.startswith("kv") and cached != memory_end:
                bad[(k, mode)] += 1  # not injected (fallback): counted and reported
            if round_ >= args.warmup:
                times[(k, mode)].append(seconds)
    ttft: dict = {m: {} for m in modes}
    for m in modes:
        ttft[m] = {str(k): median_ms(times[(k, m)]) for k in args.k}
        ttft[m]["_p90"] = {str(k): round(float(np.percentile(times[(k, m)], 90)) * 1e3, 3) for k in args.k}
        ttft[m]["_mean"] = {str(k): round(float(np.mean(times[(k, m)])) * 1e3, 3) for k in args.k}
    for k in args.k:
        print(f"k={k}: " + ", ".join(f"{m} {ttft[m][str(k)]:.2f} ms" for m in modes), flush=True)
    result["ttft_ms_detail"] = ttft
    # each round measures every cell once: the median of each round's (mode - none) at the same k
    # is steadier than a difference of medians when the machine drifts between rounds
    result["paired_minus_none_ms"] = {
        m: {str(k): round(float(np.median(np.subtract(times[(k, m)], times[(k, "none")]))) * 1e3, 3) for k in args.k}
        for m in modes[1:]
    }
    print("paired median minus none (ms):", result["paired_minus_none_ms"], flush=True)
    result["scheduler_us_median"] = {
        m: {str(k): round(float(np.median(scheduler_us[(k, m)])), 1) for k in args.k} for m in ("kv_hbm", "kv_host")
    }
    after = llm.collective_rpc(rpc_stats)[0]  # the GPU injector's counters (absent on the CPU path)
    steps = max(1, after.get("steps", 0) - steps_before.get("steps", 0))
    host_s = after.get("inject_cpu_s", 0.0) - steps_before.get("inject_cpu_s", 0.0)
    result["worker_inject_host_ms_per_step"] = round(host_s / steps * 1e3, 3)
    print("scheduler-side us per request (median):", result["scheduler_us_median"], flush=True)
    print("worker injection host ms per step:", result["worker_inject_host_ms_per_step"], flush=True)
    result["ttft_not_injected"] = {f"{k}/{m}": v for (k, m), v in bad.items() if v}
    result["stats_after_ttft"] = llm.collective_rpc(rpc_stats)[0]
    write_json(out, result)

    if args.skip_qps:
        return result
    # ---------------------------------------------------------------- throughput
    qps: dict = {"none": {}, "prompt": {}, "kv_hbm": {}}
    warm_pool()
    for mode in qps:  # warm-up of the batch shapes
        batch = [request(mode, 50, queries[j]) for j in range(8)]
        llm.generate([tokens_prompt(b[0], b[2]) for b in batch], [sampling_params(50, b[1]) for b in batch], use_tqdm=False)
    for users in args.users:
        for mode in qps:
            batch = []
            for user in range(users):
                for question in range(2):
                    ids, params, salt, _, _ = request(mode, 50, queries[(qi + 2 * user + question) % len(queries)])
                    batch.append((ids, params, salt))
            qi += 2 * users
            prompts = [tokens_prompt(ids, salt) for ids, _, salt in batch]
            sps = [sampling_params(50, params) for _, params, _ in batch]
            start = time.perf_counter()
            outs = llm.generate(prompts, sps, use_tqdm=False)
            seconds = time.perf_counter() - start
            assert all(len(o.outputs[0].token_ids) == 50 for o in outs)
            qps[mode][str(users)] = round(len(batch) / seconds, 2)
        print(f"users={users}: " + ", ".join(f"{m} {qps[m][str(users)]:.1f} QPS" for m in qps), flush=True)
        result["qps"] = qps
        write_json(out, result)
    result["stats_final"] = llm.collective_rpc(rpc_stats)[0]
    result["usage_final"] = arena.usage()
    write_json(out, result)
    return result
