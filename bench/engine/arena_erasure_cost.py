"""What erasure adds to freeing an arena entry: FactArena.release time per entry size.

    .venv/bin/python -m bench.engine.arena_erasure_cost [--dtype float32] [--out bench/results/arena_erasure_cost.json]

An arena of SmolLM2-135M's shape (30 layers, 3 KV heads, head size 64, 16-token pages) in /dev/shm,
every page written (as after captures); entries are allocated in batches, then released one by
one (each release zeroes pages the previous ones did not touch), and the median release time is
printed. Freeing an entry zeroes its token ids and KV bytes (kvarena);
run the same command with PYTHONPATH at a checkout from before erasure for the baseline.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.kit.results import write_result
from kvarena.arena import ArenaGeometry, FactArena


def median_release_us(arena: FactArena, n_tokens: int, repeats: int) -> float:
    """Median time of one release; entries are released in batches of up to 100 after all were
    allocated, so each release zeroes pages not touched since (no cache-warm repeats)."""
    pages = -(-n_tokens // arena.geometry.page_tokens)
    batch = min(100, arena.geometry.num_pages // pages // 2)
    times: list[float] = []
    while len(times) < repeats:
        refs = [arena.allocate(list(range(n_tokens)), 0) for _ in range(batch)]
        for ref in refs:
            arena.commit(ref)
        for ref in refs:
            started = time.perf_counter()
            arena.release(ref)
            times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    geometry = ArenaGeometry(num_layers=30, num_kv_heads=3, head_size=64, dtype=args.dtype, page_tokens=16,
                             num_pages=4096, max_entries=8192, max_pages_per_entry=16)  # fmt: skip
    folder = tempfile.mkdtemp(prefix="kvmem-erasure-bench-", dir="/dev/shm" if Path("/dev/shm").exists() else None)
    rows = []
    try:
        arena = FactArena.create(Path(folder) / "arena", geometry)
        arena.kv.fill_(1.0)  # every page resident, as after captures
        median_release_us(arena, 20, 50)  # warm-up
        for n_tokens in (20, 64, 256):
            pages = -(-n_tokens // geometry.page_tokens)
            row = {"tokens": n_tokens, "pages": pages, "kv_kib": pages * arena.page_bytes // 1024,
                   "release_us": round(median_release_us(arena, n_tokens, args.repeats), 1)}  # fmt: skip
            rows.append(row)
            print(f"{args.dtype} entry of {n_tokens} tokens ({pages} pages, {row['kv_kib']} KiB of KV): release {row['release_us']} us")
        arena.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.out is not None:
        write_result(args.out, {"dtype": args.dtype, "rows": rows})


if __name__ == "__main__":
    main()
