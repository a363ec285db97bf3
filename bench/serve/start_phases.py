"""The service's start, phase by phase, on this machine: Ray and Serve, the application until it
answers, the replica's own phases from /v1/shards and vLLM's start lines (docs/bench.md)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.kit.results import median, table, write_result
from bench.kit.service import serve_in_process, small_service_args

VLLM_LINES = re.compile(
    r"(Started initializing replica|memory plan|started: process_to_constructor|Initializing a V1 LLM engine|"
    r"Starting to load model|Initializing model took|Model loading took|Loading weights took|"
    r"init engine \(profile, create kv cache, warmup model\) took|torch\.compile take|Graph capturing finished|"
    r"Memory profiling takes|Available KV cache memory|KV cache size|Maximum concurrency)"
)


def vllm_start_lines(logs: Path) -> list[str]:
    """The replica's start lines and vLLM's own phase lines from this Ray session's logs (the engine core logs there)."""
    lines: list[str] = []
    for path in sorted([*logs.glob("worker-*"), *logs.glob("serve/replica_*")]) if logs.is_dir() else []:
        for line in path.read_text(errors="replace").splitlines():
            if VLLM_LINES.search(line):
                lines.append(line.strip()[:300])
    return lines


def one_start(redis_url: str, model_dir: Path, namespace: str) -> dict[str, Any]:
    import ray
    import requests

    arena_dir = tempfile.mkdtemp(prefix=f"kvmem-{namespace}-", dir="/dev/shm")
    timings: dict[str, float] = {}
    try:
        with serve_in_process(small_service_args(redis_url, model_dir, namespace, arena_dir), timings=timings) as url:
            shard = requests.get(f"{url}/v1/shards", timeout=30).json()["results"][0]
            return {
                **timings,
                "total_s": round(timings["ray_and_serve_s"] + timings["app_running_s"], 2),
                "replica_start_phases": shard.get("start_phases"),
                "memory_plan": shard.get("memory_plan"),
                "vllm_lines": vllm_start_lines(Path(ray._private.worker._global_node.get_logs_dir_path())),  # this session's logs
            }
    finally:
        shutil.rmtree(arena_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--out", type=Path, default=Path("bench/results/start_phases_cpu.json"))
    args = parser.parse_args()

    from devtools.local_redis import LocalRedis
    from devtools.offline_models import prepare_smollm2

    model_dir = prepare_smollm2()
    runs = []
    with LocalRedis(Path(tempfile.mkdtemp(prefix="kvmem-start-redis-"))) as redis:
        for i in range(args.repeats):
            runs.append(one_start(redis.url, model_dir, f"start{i}-{int(time.time())}"))
            print(json.dumps(runs[-1], indent=1), flush=True)
    rows = [[key, median([r[key] for r in runs])] for key in ("ray_and_serve_s", "app_running_s", "total_s")]
    for prefix, of in (("replica", lambda r: r["replica_start_phases"] or {}), ("shard", lambda r: (r["replica_start_phases"] or {}).get("shard") or {})):
        for key in sorted({k for r in runs for k, v in of(r).items() if isinstance(v, (int, float))}):
            rows.append([f"{prefix}: {key}", median([of(r)[key] for r in runs if key in of(r)])])
    print(f"\nstart of the CPU service ({args.label}), median of {len(runs)} first starts")
    print(table(rows, ["phase", "seconds"]))
    write_result(args.out, {"label": args.label, "command": "python -m bench.serve.start_phases", "runs": runs})


if __name__ == "__main__":
    main()
