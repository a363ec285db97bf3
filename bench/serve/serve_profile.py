"""Where the served application's processes spend their time under load (issue 10's QPS gap): py-spy
profiles. Usage: docs/bench.md."""

from __future__ import annotations

import collections
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.serve.http_measures import Context, run_locust, seed_locust_pool

RATE_HZ = 200
# process title (as Ray and vLLM set it) -> the name this report gives it
PROCESSES = {"ProxyActor": "proxy", "LLMReplica": "replica", "ShardActor": "shard", "EngineCore": "engine_core"}


def find_processes() -> dict[str, int]:
    """pid of each process in PROCESSES (the first match of its title)."""
    import psutil

    found: dict[str, int] = {}
    for process in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(process.info["cmdline"] or [])
        for marker, name in PROCESSES.items():
            if marker in title and name not in found and "py-spy" not in title:
                found[name] = process.info["pid"]
    return found


def py_spy() -> str | None:
    staged = Path(".serve-stage/bin/py-spy")
    return str(staged) if staged.exists() else shutil.which("py-spy")


def summarize(raw: Path, seconds: float, top: int = 25) -> dict[str, Any]:
    """The share of the time the GIL was held and the top functions of py-spy's collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        frames = stack.split(";")
        total += samples
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples

    def share(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(frame, round(100 * n / total, 1)) for frame, n in counter.most_common(top)] if total else []

    return {"samples": total, "gil_busy": round(total / (seconds * RATE_HZ), 2), "self_pct": share(own), "total_pct": share(inclusive)}


def profile(ctx: Context) -> dict[str, Any]:
    """Locust at `ctx.profile_users` users per mode, py-spy on each process of the path."""
    binary = py_spy()
    if binary is None:
        return {"serve_profile": {"error": "py-spy not found"}}
    seed_locust_pool(ctx)
    pids = find_processes()
    seconds = ctx.locust_seconds
    workdir = Path(tempfile.mkdtemp(prefix="kvmem-profile-"))
    result: dict[str, Any] = {"pids": pids, "users": ctx.profile_users, "rate_hz": RATE_HZ}
    for mode in ("none", "kv"):
        sampled = seconds - 4  # after Locust's ramp-up, before its stop
        spies = {  # started 2 s into the run (after the ramp-up), each sampling one process
            name: subprocess.Popen(
                ["bash", "-c", f"sleep 2 && exec {binary} record --pid {pid} --rate {RATE_HZ} --duration {sampled} "
                               f"--format raw --gil --nonblocking --output {workdir / f'{mode}_{name}.txt'}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )
            for name, pid in pids.items()
        }
        rows = run_locust(ctx, mode, ctx.profile_users, seconds, workdir / f"locust_{mode}", "varied")
        per_process: dict[str, Any] = {"qps": round(float(rows["chat"].get("Requests/s", 0) or 0), 2)}
        for name, spy in spies.items():
            _, err = spy.communicate(timeout=60)
            raw = workdir / f"{mode}_{name}.txt"
            per_process[name] = summarize(raw, sampled) if raw.exists() else {"error": err.decode()[-500:]}
        result[mode] = per_process
    return {"serve_profile": result}
