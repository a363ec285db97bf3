"""Host (CPU) time the connector spends per injecting request, without an engine or a GPU: its
scheduler side and its worker side (HBM hit and miss). Usage: docs/bench.md."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import types
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from bench.kit.results import table, write_result
from connector.scheduler import KVMemoryScheduler
from kvarena.arena import ArenaGeometry, FactArena
from memory.composition import StoredSegment, compose

POOL = 300  # facts in the arena
FACT_TOKENS = (12, 30)  # LoCoMo observation facts are ~20 tokens


def _arena(root: Path) -> tuple[FactArena, list[StoredSegment]]:
    geometry = ArenaGeometry(
        num_layers=2, num_kv_heads=2, head_size=64, dtype="float32", page_tokens=16, num_pages=2048, max_entries=1024
    )
    arena = FactArena.create(root / "arena", geometry)
    rng = np.random.default_rng(0)
    segments = []
    for _ in range(POOL):
        tokens = rng.integers(10, 1000, int(rng.integers(*FACT_TOKENS))).tolist()
        ref = arena.allocate(tokens, encode_start=0)
        arena.commit(ref)
        segments.append(StoredSegment(ref, tuple(tokens)))
    return arena, segments


def one_request(side: KVMemoryScheduler, segments: list[StoredSegment], compose_fn: Callable[..., Any], chosen: np.ndarray) -> tuple[float, Any]:
    """Seconds of scheduler-side host time for one request injecting the chosen facts (plan, pin,
    token check, inject op, finish), and its inject op."""
    composed = compose_fn([segments[i] for i in chosen], [5, 6, 7], namespace="bench")
    request = types.SimpleNamespace(
        request_id=uuid.uuid4().hex,
        kv_transfer_params=composed.kv_transfer_params(),
        prompt_token_ids=composed.prompt_token_ids,
        cache_salt=composed.cache_salt,
        num_prompt_tokens=len(composed.prompt_token_ids),
    )
    started = time.perf_counter()
    granted = side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, granted)
    plan = side.plans[request.request_id]
    plan.block_ids = list(range(len(composed.prompt_token_ids) // 16 + 1))
    metadata = types.SimpleNamespace(injects=[], captures=[])
    side._emit(plan, request.request_id, 0, types.SimpleNamespace(num_scheduled_tokens={}), metadata)
    side.request_finished(request)
    elapsed = time.perf_counter() - started
    assert granted > 0 and len(metadata.injects) == 1, "the request was not injected"
    return elapsed, metadata.injects[0]


def scheduler_us(arena: FactArena, segments: list[StoredSegment], k: int, n: int, rng: np.random.Generator) -> float:
    side = KVMemoryScheduler(arena, block_size=16)
    times = [one_request(side, segments, compose, rng.choice(len(segments), k, replace=False))[0] for _ in range(n)]
    return float(np.median(times) * 1e6)


def worker_us(arena: FactArena, segments: list[StoredSegment], k: int, n: int, rng: np.random.Generator) -> dict[str, float]:
    from connector.gpu_injector import GpuInjector
    from connector.rotary import KeyRepositioner
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    g = arena.geometry
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(g.head_size, max_position=4096, is_neox_style=True, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, dtype=torch.float32)
    caches = [torch.zeros((128, 2, 16, g.num_kv_heads, g.head_size)) for _ in range(g.num_layers)]
    injector = GpuInjector(arena, caches, KeyRepositioner.from_rope(rope, g.head_size), device_pages=g.num_pages)
    noop = lambda *args, **kwargs: None  # noqa: E731 - the kernels are what this leaves out
    injector.kernels = types.SimpleNamespace(inject=noop, copy_rows=noop)
    views = [arena.pin(s.ref.entry_id, s.ref.generation) for s in segments]

    def one_step() -> float:
        chosen = rng.choice(len(views), k, replace=False)
        slots = np.concatenate([views[i].token_slots for i in chosen])
        started = time.perf_counter()
        injector._inject_step(slots, np.arange(len(slots)) % 2048, np.arange(len(slots)) % 1000, layerwise=False)
        return time.perf_counter() - started

    misses = []
    for _ in range(n):
        injector.drop_device_tier()
        misses.append(one_step())
    for _ in range(3 * POOL // k + 10):  # promote every fact's pages
        one_step()
    hits = [one_step() for _ in range(n)]
    return {"hit": float(np.median(hits) * 1e6), "miss": float(np.median(misses) * 1e6)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=lambda v: [int(x) for x in v.split(",")], default=[5, 10, 20, 50])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("bench/results/connector_host_overhead.json"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvmem-hostbench-", dir="/dev/shm" if Path("/dev/shm").exists() else None))
    rng = np.random.default_rng(1)
    rows = {}
    try:
        arena, segments = _arena(root)
        for k in args.k:
            rows[str(k)] = {"scheduler_us": round(scheduler_us(arena, segments, k, args.requests, rng), 1)}
            rows[str(k)].update({f"worker_{name}_us": round(v, 1) for name, v in worker_us(arena, segments, k, args.requests, rng).items()})
        arena.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table([[k, r["scheduler_us"], r["worker_hit_us"], r["worker_miss_us"]] for k, r in rows.items()],
                ["k", "scheduler us", "worker hit us", "worker miss us"], ".1f"))
    write_result(args.out, {"host_us_median": rows, "requests": args.requests})


if __name__ == "__main__":
    main()
