"""Report of the engine benchmark (bench/engine/engine_h200.py): merge the part JSONs into
engine_h200.json, the text table, the TTFT/QPS plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.engine.engine_h200_common import K_VALUES, USERS, write_json


def merge(out: Path) -> dict:
    def load(name):
        path = out / f"part_{name}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    smoke, e8, eq = load("smoke"), load("engine8b"), load("equiv")
    detail = e8.get("ttft_ms_detail", {})
    none_values = [v for k, v in detail.get("none", {}).items() if not k.startswith("_")]
    ttft = {
        "none": round(statistics.median(none_values), 3) if none_values else None,
        **{m: {k: v for k, v in detail.get(m, {}).items() if not k.startswith("_")} for m in ("prompt", "kv_hbm", "kv_host")},
    }
    result = {
        "ttft_ms": ttft,
        "qps": e8.get("qps", {}),
        "bf16_identical_share": eq.get("identical_share_hbm"),
        "bf16_identical_share_host": eq.get("identical_share_host"),
        "bf16_max_first_token_logprob_gap": eq.get("max_first_token_logprob_gap_hbm"),
        # control: vLLM's own prefix cache (KV from its own prefill, query-only prefill) vs a cold prefill
        "bf16_control_prefix_cache_identical_share": eq.get("control_identical_share_prefix_cached"),
        "bf16_control_prefix_cache_max_gap": eq.get("control_max_gap_prefix_cached"),
        "bf16_control_cold_vs_cold_identical_share": eq.get("control_identical_share_cold_vs_plain"),
        "ttft_ms_none_per_k": {k: v for k, v in detail.get("none", {}).items() if not k.startswith("_")},
        "ttft_p90_ms": {m: detail.get(m, {}).get("_p90") for m in detail},
        "setup": {
            "gpu": smoke.get("device"), "vllm": smoke.get("vllm"), "torch": smoke.get("torch"), "triton": smoke.get("triton"),
            "model": "Llama-3.1-8B architecture, load_format=dummy, bf16, prefix caching on, default compilation config",
            "equiv_model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to bf16), real weights",
        },  # fmt: skip
        "checks": {
            "kernel_tests_rc": smoke.get("kernel_tests", {}).get("rc"),
            "micro": smoke.get("micro"),
            "ttft_not_injected": e8.get("ttft_not_injected"),
            "engine_start_s": e8.get("engine_start_s"),
            "capture_s": e8.get("capture_s"),
            "worker_stats": e8.get("stats_final") or e8.get("stats_after_ttft"),
            "arena_usage": e8.get("usage_final"),
            "equiv_injected_all": eq.get("injected_all"),
            "equiv_mean_memory_tokens": eq.get("mean_memory_tokens"),
        },
        "errors": {name: load(name).get("error") for name in ("smoke", "engine8b", "equiv") if load(name).get("error")},
    }
    write_json(out / "engine_h200.json", result)
    return result


def table(result: dict) -> str:
    t = result["ttft_ms"]
    lines = ["TTFT (ms, median)     " + "".join(f"k={k:<8}" for k in K_VALUES)]
    per_k = result.get("ttft_ms_none_per_k", {})
    lines.append(f"{'none':<22}" + "".join(f"{per_k.get(str(k), float('nan')):<10.2f}" for k in K_VALUES))
    for mode in ("prompt", "kv_hbm", "kv_host"):
        lines.append(f"{mode:<22}" + "".join(f"{t.get(mode, {}).get(str(k), float('nan')):<10.2f}" for k in K_VALUES))
    q = result["qps"]
    lines.append("QPS (k=50, 50 tokens) " + "".join(f"{u:<8}" for u in USERS) + "users")
    for mode in ("none", "prompt", "kv_hbm"):
        lines.append(f"{mode:<22}" + "".join(f"{q.get(mode, {}).get(str(u), float('nan')):<8.1f}" for u in USERS))
    lines.append(f"bf16 identical greedy continuations: HBM {result.get('bf16_identical_share')}, host {result.get('bf16_identical_share_host')}; "
                 f"max first-token logprob gap {result.get('bf16_max_first_token_logprob_gap')}")  # fmt: skip
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    t = result["ttft_ms"]
    if t.get("none") is not None:
        a.axhline(t["none"], color="gray", linestyle="--", label="no memory")
    for mode, style in (("prompt", "o-"), ("kv_hbm", "s-"), ("kv_host", "^-")):
        ys = [t.get(mode, {}).get(str(k)) for k in K_VALUES]
        if all(y is not None for y in ys):
            a.plot(K_VALUES, ys, style, label=mode)
    a.set(xlabel="retrieved facts k", ylabel="engine TTFT (ms, median)", title="TTFT vs k (Llama-3.1-8B shape, H200)")
    a.legend()
    for mode, style in (("none", "x--"), ("prompt", "o-"), ("kv_hbm", "s-")):
        ys = [result["qps"].get(mode, {}).get(str(u)) for u in USERS]
        if all(y is not None for y in ys):
            b.plot(USERS, ys, style, label=mode)
    b.set(xlabel="users (x2 questions)", ylabel="QPS", title="Throughput, k=50, 50 output tokens")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
