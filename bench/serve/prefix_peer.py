"""The natural alternative as a peer (issue 11): a user's whole memory as a fixed prompt prefix
(memory mode `full`) against retrieval + KV injection and retrieval + prompt injection (docs/bench.md)."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.kit.results import median
from bench.kit.client import seed_user, stream_once
from bench.serve.http_measures import Context

SIZES = (100, 500, 1000, 5000)
PEER_MODES = ("kv", "prompt", "full")
TOP_K = 10


def _facts(ctx: Context, n: int) -> list[str]:
    from bench.quality.locomo_qa import load_conversations

    pool = [f for conv in load_conversations(ctx.locomo, None, "peer", None, None) for facts in conv.facts_by_turn.values() for f in facts]
    return [pool[i % len(pool)] if i < len(pool) else f"{pool[i % len(pool)]} (note {i // len(pool)})" for i in range(n)]


def _questions(ctx: Context) -> list[str]:
    from bench.quality.locomo_qa import load_conversations

    return [q["question"] for conv in load_conversations(ctx.locomo, None, "peer", None, None) for q in conv.questions]


def _body(user: str, mode: str, question: str, max_tokens: int) -> dict[str, Any]:
    return {"user": user, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "memory": {"mode": mode, "top_k": TOP_K}}


def _qps(ctx: Context, user: str, mode: str, questions: list[str], clients: int, seconds: float) -> dict[str, Any]:
    """Closed loop: `clients` threads each send the next request when the last one finished."""
    stop_at = time.monotonic() + seconds
    ttfts: list[float] = []

    def loop(index: int) -> int:
        done = 0
        with ctx.client() as client:
            while time.monotonic() < stop_at:
                sample = stream_once(client, "/v1/chat/completions", _body(user, mode, questions[(index * 97 + done) % len(questions)], 50))
                ttfts.append(sample["http_ms"])
                done += 1
        return done

    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        completed = sum(pool.map(loop, range(clients)))
    elapsed = time.monotonic() - started
    ttfts.sort()
    return {"qps": round(completed / elapsed, 2), "requests": completed,
            "ttft_p50_ms": median(ttfts), "ttft_p99_ms": round(ttfts[min(len(ttfts), math.ceil(0.99 * len(ttfts))) - 1], 2) if ttfts else None}


def peer(ctx: Context, sizes: tuple[int, ...] = SIZES, clients: int = 32, seconds: float = 10.0) -> dict[str, Any]:
    questions = _questions(ctx)
    out: dict[str, Any] = {}
    for n in sizes:
        if ctx.deadline - time.monotonic() < 60:
            out[str(n)] = "skipped: out of time"
            continue
        user = f"bench-peer-{n}"
        row: dict[str, Any] = {}
        with ctx.client(timeout_s=600) as client:
            row["facts"] = seed_user(client, user, _facts(ctx, n))
            cold = stream_once(client, "/v1/chat/completions", _body(user, "full", questions[0], 1))
            row["full_cold"] = {"http_ms": cold["http_ms"], "engine_ms": cold["stages"].get("engine_ttft")}
            samples: dict[str, list[dict[str, Any]]] = {mode: [] for mode in PEER_MODES}
            for r in range(ctx.rounds):
                for mode in PEER_MODES:
                    samples[mode].append(stream_once(client, "/v1/chat/completions", _body(user, mode, questions[1 + r], 1)))
        for mode, rows in samples.items():
            row[mode] = {"http_ttft_ms": median([s["http_ms"] for s in rows]),
                         "engine_ttft_ms": median([s["stages"]["engine_ttft"] for s in rows if "engine_ttft" in s["stages"]]),
                         "cached_tokens": median([s["cached_tokens"] or 0 for s in rows]),
                         "prompt_tokens": median([s["prompt_tokens"] or 0 for s in rows])}
        for mode in PEER_MODES:
            row[mode].update(_qps(ctx, user, mode, questions, clients, seconds))
        out[str(n)] = row
        print(f"[peer] {n} facts: " + ", ".join(f"{m} {row[m]['http_ttft_ms']} ms / {row[m]['qps']} QPS" for m in PEER_MODES), flush=True)
    return {"prefix_cache_peer": {"top_k": TOP_K, "clients": clients, "seconds": seconds, "sizes": out}}


def plot_peer(result: dict[str, Any], path) -> None:
    """TTFT (one request at a time) and QPS per mode against the user's memory size (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = {int(n): row for n, row in result["prefix_cache_peer"]["sizes"].items() if isinstance(row, dict)}
    xs = sorted(sizes)
    fig, (ax_ttft, ax_qps) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in PEER_MODES:
        ax_ttft.plot(xs, [sizes[n][mode]["http_ttft_ms"] for n in xs], marker="o", label=f"{mode} (HTTP)")
        ax_qps.plot(xs, [sizes[n][mode]["qps"] for n in xs], marker="o", label=mode)
    ax_ttft.plot(xs, [sizes[n]["full_cold"]["http_ms"] for n in xs], "k:", marker="x", label="full, first request (cold)")
    for ax in (ax_ttft, ax_qps):
        ax.set_xscale("log")
        ax.set_xlabel("facts in the user's memory")
        ax.legend()
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("TTFT ms (median, one request at a time)")
    ax_ttft.set_title("TTFT: retrieval (k = 10) vs the whole memory as a cached prefix")
    ax_qps.set_ylabel(f"QPS ({result['prefix_cache_peer']['clients']} clients, 50 tokens)")
    ax_qps.set_title("throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
