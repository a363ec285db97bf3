"""KV injection in the engine alone, on a GPU (vLLM 0.25.1): TTFT and QPS, in parts that each run
in a process of their own. Parts and usage: docs/bench.md."""

from __future__ import annotations

import argparse
import random
import time
import uuid
from pathlib import Path

from bench.engine.engine_setup import (
    capture_segments, dummy_model, fact_geometry, make_engine, new_arena, prepare_data, rpc_drop, rpc_stats, sampling_params, tokens_prompt,
)  # fmt: skip
from bench.kit.results import card_tag, median, percentiles, read_json, table, write_result
from bench.kit.stage import DATA, LLAMA8B_CONFIG, gpu_env, load_parts, part_main, run_part

K_VALUES = (5, 10, 20, 50)
USERS = (10, 25, 50, 75, 100)
MODES = ("none", "prompt", "kv_hbm", "kv_host")


def ttft_qps(args: argparse.Namespace) -> dict:
    """Part engine8b: TTFT per mode and k, then QPS per batch of users."""
    import numpy as np

    from memory.composition import compose

    data = read_json(args.data / "locomo_tokens.json")
    rng = random.Random(1)
    config = read_json(args.model_config)
    pool_facts = rng.sample(data["facts"], args.pool)
    geometry = fact_geometry(config, pool_facts, data["prefix"])
    arena = new_arena(geometry, "8b")
    result: dict = {"arena": {"pages": geometry.num_pages, "GiB": round(geometry.kv_bytes() / 2**30, 2), "pool_facts": args.pool},
                    "block_size": args.block_size or 16}
    out = args.out / "part_engine8b.json"
    started = time.perf_counter()
    llm = make_engine(dummy_model(config, "engine-model-"), arena.path, device_pages=geometry.num_pages, gpu_mem=0.80, max_len=8192,
                      enforce_eager=args.eager, block_size=args.block_size)
    result["engine_start_s"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    prefix_seg = capture_segments(llm, arena, [(data["prefix"], 0, len(data["prefix"]))])[0]
    pool = capture_segments(llm, arena, [(f, 0, len(f)) for f in pool_facts])
    result["capture_s"] = round(time.perf_counter() - started, 2)
    result["stats_after_capture"] = llm.collective_rpc(rpc_stats)[0]
    result["usage_after_capture"] = arena.usage()
    print(f"engine up in {result['engine_start_s']} s; captured {len(pool)} facts;", result["stats_after_capture"], flush=True)
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

    # Every round measures each (k, mode) once, in a fresh random order, so that drift of the
    # machine touches all cells alike. kv_host demotes only its own request's entries first
    # (they are promoted again by the request), so the pool stays resident for kv_hbm.
    cells = [(k, m) for k in args.k for m in MODES]
    times: dict = {cell: [] for cell in cells}
    scheduler_us: dict = {cell: [] for cell in cells}  # connector scheduler-side host time per request
    bad: dict = {cell: 0 for cell in cells}
    steps_before = llm.collective_rpc(rpc_stats)[0]
    qi = 0
    for round_ in range(args.requests + args.warmup):
        rng.shuffle(cells)
        for k, mode in cells:
            ids, params, salt, memory_end, entries = request(mode, k, queries[qi % len(queries)])
            qi += 1
            if mode == "kv_host":  # this request's entries leave the HBM tier: read from host memory
                llm.collective_rpc(rpc_drop, args=(entries,))
            start = time.perf_counter()
            (o,) = llm.generate([tokens_prompt(ids, salt)], sampling_params(1, params), use_tqdm=False)
            seconds = time.perf_counter() - start
            report = (getattr(o, "kv_transfer_params", None) or {}).get("kvmem") or {}
            scheduler_us[(k, mode)].append(float(report.get("scheduler_us", 0.0)))
            if mode.startswith("kv") and (o.num_cached_tokens or 0) != memory_end:
                bad[(k, mode)] += 1  # not injected (fallback): counted and reported
            if round_ >= args.warmup:
                times[(k, mode)].append(seconds)
    ttft: dict = {}
    for m in MODES:
        ttft[m] = {str(k): median(times[(k, m)], 1e3) for k in args.k}
        ttft[m]["_p90"] = {str(k): percentiles(times[(k, m)], (90,), 1e3)["p90"] for k in args.k}
        ttft[m]["_mean"] = {str(k): round(float(np.mean(times[(k, m)])) * 1e3, 3) for k in args.k}
    print(table([[k, *(ttft[m][str(k)] for m in MODES)] for k in args.k], ["k", *(f"{m} ms" for m in MODES)]), flush=True)
    result["ttft_ms_detail"] = ttft
    # each round measures every cell once: the median of each round's (mode - none) at the same k
    # is steadier than a difference of medians when the machine drifts between rounds
    result["paired_minus_none_ms"] = {
        m: {str(k): round(float(np.median(np.subtract(times[(k, m)], times[(k, "none")]))) * 1e3, 3) for k in args.k} for m in MODES[1:]
    }
    result["scheduler_us_median"] = {m: {str(k): median(scheduler_us[(k, m)], digits=1) for k in args.k} for m in ("kv_hbm", "kv_host")}
    after = llm.collective_rpc(rpc_stats)[0]  # the GPU injector's counters (absent on the CPU path)
    steps = max(1, after.get("steps", 0) - steps_before.get("steps", 0))
    result["worker_inject_host_ms_per_step"] = round((after.get("inject_cpu_s", 0.0) - steps_before.get("inject_cpu_s", 0.0)) / steps * 1e3, 3)
    print({k: result[k] for k in ("paired_minus_none_ms", "scheduler_us_median", "worker_inject_host_ms_per_step")}, flush=True)
    result["ttft_not_injected"] = {f"{k}/{m}": v for (k, m), v in bad.items() if v}
    result["stats_after_ttft"] = after
    write_result(out, result, quiet=True)
    if args.skip_qps:
        return result
    qps: dict = {"none": {}, "prompt": {}, "kv_hbm": {}}
    order = list(range(len(pool)))  # every pool fact injected once: all resident in the HBM tier again
    rng.shuffle(order)
    for start in range(0, len(order), 50):
        composed = compose([prefix_seg, *(pool[i] for i in order[start : start + 50])], queries[0], namespace=uuid.uuid4().hex)
        llm.generate([tokens_prompt(composed.prompt_token_ids, composed.cache_salt)], sampling_params(1, composed.params), use_tqdm=False)
    for users in (0, *args.users):  # 0: a warm-up of the batch shapes, 8 requests
        for mode in qps:
            batch = [request(mode, 50, queries[(qi + j) % len(queries)])[:3] for j in range(2 * users or 8)]
            qi += len(batch)
            start = time.perf_counter()
            outs = llm.generate([tokens_prompt(ids, salt) for ids, _, salt in batch], [sampling_params(50, p) for _, p, _ in batch], use_tqdm=False)
            seconds = time.perf_counter() - start
            assert all(len(o.outputs[0].token_ids) == 50 for o in outs)
            if users:
                qps[mode][str(users)] = round(len(batch) / seconds, 2)
        if users:
            print(f"users={users}: " + ", ".join(f"{m} {qps[m][str(users)]:.1f} QPS" for m in qps), flush=True)
            result["qps"] = qps
            write_result(out, result, quiet=True)
    result["stats_final"] = llm.collective_rpc(rpc_stats)[0]
    result["usage_final"] = arena.usage()
    return result


def merge(out: Path) -> dict:
    """The parts' results as OUT/engine_<card>.json."""
    parts = load_parts(out, ["smoke", "engine8b"])
    smoke, e8 = parts["smoke"], parts["engine8b"]
    detail = e8.get("ttft_ms_detail", {})
    plain = {m: {k: v for k, v in detail.get(m, {}).items() if not k.startswith("_")} for m in MODES}
    result = {
        "card": smoke.get("device") or e8.get("card"),
        "ttft_ms": {"none": median(list(plain["none"].values())), **{m: plain[m] for m in MODES[1:]}},
        "qps": e8.get("qps", {}),
        "ttft_ms_none_per_k": plain["none"],
        "ttft_p90_ms": {m: detail.get(m, {}).get("_p90") for m in detail},
        "setup": {
            "gpu": smoke.get("device"), "vllm": smoke.get("vllm"), "torch": smoke.get("torch"), "triton": smoke.get("triton"),
            "model": "Llama-3.1-8B architecture, load_format=dummy, bf16, prefix caching on, default compilation config",
        },  # fmt: skip
        "checks": {
            "kernel_tests_rc": smoke.get("kernel_tests", {}).get("rc"),
            "ttft_not_injected": e8.get("ttft_not_injected"), "engine_start_s": e8.get("engine_start_s"), "capture_s": e8.get("capture_s"),
            "worker_stats": e8.get("stats_final") or e8.get("stats_after_ttft"), "arena_usage": e8.get("usage_final"),
        },  # fmt: skip
        "errors": {name: part["error"] for name, part in parts.items() if part.get("error")},
    }
    write_result(out / f"engine_{card_tag(result['card'] or None)}.json", result)
    return result


def report(result: dict) -> str:
    t, q, per_k = result["ttft_ms"], result["qps"], result.get("ttft_ms_none_per_k", {})
    rows = [["none", *(per_k.get(str(k)) for k in K_VALUES)], *([m, *(t.get(m, {}).get(str(k)) for k in K_VALUES)] for m in MODES[1:])]
    lines = [table(rows, ["TTFT ms (median)", *(f"k={k}" for k in K_VALUES)])]
    rows = [[m, *(q.get(m, {}).get(str(u)) for u in USERS)] for m in ("none", "prompt", "kv_hbm")]
    lines.append(table(rows, ["QPS (k=50, 50 tokens)", *(f"{u} users" for u in USERS)], ".1f"))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    t = result["ttft_ms"]
    if t.get("none") is not None:
        a.axhline(t["none"], color="gray", linestyle="--", label="no memory")
    for ax, xs, rows, styles in ((a, K_VALUES, t, (("prompt", "o-"), ("kv_hbm", "s-"), ("kv_host", "^-"))),
                                 (b, USERS, result["qps"], (("none", "x--"), ("prompt", "o-"), ("kv_hbm", "s-")))):
        for mode, style in styles:
            ys = [rows.get(mode, {}).get(str(x)) for x in xs]
            if all(y is not None for y in ys):
                ax.plot(xs, ys, style, label=mode)
        ax.legend()
    a.set(xlabel="retrieved facts k", ylabel="engine TTFT (ms, median)", title=f"TTFT vs k (Llama-3.1-8B shape, {result.get('card')})")
    b.set(xlabel="users (x2 questions)", ylabel="QPS", title="Throughput, k=50, 50 output tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare-data", action="store_true")
    parser.add_argument("--all", action="store_true", help="run every part (subprocesses), merge, print, plot")
    parser.add_argument("--part", choices=("smoke", "engine8b"))
    parser.add_argument("--merge", action="store_true", help="merge the parts an earlier run left in --out")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out with --all")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pool", type=int, default=600)
    parser.add_argument("--skip-qps", action="store_true", help="engine8b: TTFT only, no throughput batches")
    parser.add_argument("--model-config", type=Path, default=LLAMA8B_CONFIG)
    parser.add_argument("--k", type=ints, default=list(K_VALUES))
    parser.add_argument("--users", type=ints, default=list(USERS))
    parser.add_argument("--block-size", type=int, default=None, help="engine8b: vLLM's KV block size (default: vLLM's, 16 on a GPU)")
    parser.add_argument("--eager", action="store_true", help="enforce_eager engines: only for a dry run on a CPU machine")
    args = parser.parse_args()
    gpu_env()
    if args.prepare_data:
        return prepare_data(args.data)
    args.out.mkdir(parents=True, exist_ok=True)
    argv = [a for a in __import__("sys").argv[1:] if a != "--all"]
    if args.part:
        from bench.engine import kernel_timing

        run = {"smoke": kernel_timing.run, "engine8b": ttft_qps}[args.part]
        return part_main(lambda: run(args), args.out / f"part_{args.part}.json")
    if args.all:
        skip = set(filter(None, args.skip.split(",")))
        for part, budget in {"smoke": 200, "engine8b": 330}.items():
            if part not in skip:
                run_part("bench.engine.engine_ttft", part, argv, budget)
    if args.all or args.merge:
        result = merge(args.out)
        print(report(result))
        try:
            plot(result, args.out / f"engine_{card_tag(result['card'] or None)}.png")
        except Exception as exc:  # noqa: BLE001
            print("plot failed:", exc)


if __name__ == "__main__":
    main()
