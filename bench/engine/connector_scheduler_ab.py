"""The connector's scheduler side in two checkouts, side by side in one process.

Host time per injecting request (plan, pin, token check, inject op, finish; the same work
bench/engine/connector_host_overhead.py times) of this tree against another checkout of the
repository, interleaved request by request in random order, so that the drift of a shared
machine hits both alike (run one after the other, the medians on this 2-core VM moved by 2x).
Both trees get the same facts and the same requests, and their inject ops must be equal.

    git worktree add /tmp/kvmem-before <commit>
    .venv/bin/python -m bench.engine.connector_scheduler_ab --against /tmp/kvmem-before \\
        [--out bench/results/connector_scheduler_ab.json]

Each tree's packages (kvarena, connector, memory, bench) are imported from its own folder in
turn: the module cache is cleared between the two imports, so each tree's classes keep
references to their own modules. The request itself is connector_host_overhead.one_request.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.engine.connector_host_overhead import one_request  # duck-typed: runs on either tree's classes
from bench.kit.results import REPO as HERE
from bench.kit.results import table, write_result

PACKAGES = ("connector", "kvarena", "memory", "bench")


def load_tree(root: Path, shm: Path) -> tuple[Any, list[Any], Callable[..., Any]]:
    """(KVMemoryScheduler over a fresh arena of the bench's facts, the facts, compose) of one checkout."""
    for name in [m for m in sys.modules if m.split(".")[0] in PACKAGES]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        scheduler = importlib.import_module("connector.scheduler")
        compose = importlib.import_module("memory.composition").compose
        try:
            host_bench = importlib.import_module("bench.engine.connector_host_overhead")
        except ModuleNotFoundError:  # a checkout from before bench/ was grouped (issue 24)
            host_bench = importlib.import_module("bench.connector_host_overhead")
    finally:
        sys.path.remove(str(root))
    arena, segments = host_bench._arena(Path(tempfile.mkdtemp(dir=shm)))
    return scheduler.KVMemoryScheduler(arena, block_size=16), segments, compose


def same_op(a: Any, b: Any) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("arena_slots", "cache_slots", "distances"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, required=True, help="the other checkout (e.g. a git worktree of an older commit)")
    parser.add_argument("--k", type=int, nargs="+", default=[5, 10, 20, 50])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--out", type=Path, default=Path("bench/results/connector_scheduler_ab.json"))
    args = parser.parse_args()
    shm = Path("/dev/shm") if Path("/dev/shm").exists() else Path(tempfile.gettempdir())
    trees = {"against": load_tree(args.against.resolve(), shm), "this": load_tree(HERE, shm)}
    rng = np.random.default_rng(0)
    rows: dict[str, dict[str, float]] = {}
    for k in args.k:
        times: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(args.requests):
            chosen = rng.choice(len(trees["this"][1]), k, replace=False)
            ops = {}
            for name in (("against", "this") if rng.random() < 0.5 else ("this", "against")):
                elapsed, ops[name] = one_request(*trees[name], chosen)
                times[name].append(elapsed)
            assert same_op(ops["against"], ops["this"]), "the two trees planned different inject ops"
        against, this = (float(np.median(times[name]) * 1e6) for name in ("against", "this"))
        rows[str(k)] = {"against_us": round(against, 1), "this_us": round(this, 1), "ratio": round(this / against, 3)}
    print(table([[k, r["against_us"], r["this_us"], r["ratio"]] for k, r in rows.items()], ["k", "against us", "this us", "this/against"]))
    commit = lambda root: subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "scheduler_us_median": rows, "requests_per_k": args.requests, "this": f"{commit(HERE)} (+ working tree)",
        "against": commit(args.against), "inject_ops_equal": True,
        "command": f"python -m bench.engine.connector_scheduler_ab --against <worktree of {commit(args.against)}>",
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
