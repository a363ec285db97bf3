"""The injection kernels on the GPU (part `smoke` of bench/engine/engine_ttft.py): the Triton kernel
tests compiled, and micro-timings at the Llama-3.1-8B shape (docs/bench.md)."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.kit.results import REPO


def run(args) -> dict:
    """The kernel tests' result and the micro-timings (ms, GB/s, host us per launch)."""
    import torch

    result: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    try:
        import triton
        import vllm

        result.update(triton=triton.__version__, vllm=vllm.__version__)
    except Exception as exc:  # noqa: BLE001
        result["import_error"] = repr(exc)
    test = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--noconftest", "tests/test_triton_inject.py", "tests/test_gpu_tiers.py"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    result["kernel_tests"] = {"rc": test.returncode, "tail": test.stdout[-1500:] + test.stderr[-1500:]}
    print(test.stdout[-800:], flush=True)

    from triton.testing import do_bench

    from connector import triton_inject as ti
    from connector.host_pinning import pin_host_tensor

    layers, heads, head, tokens, block = 32, 8, 128, 1024, 16
    dev = torch.device("cuda")
    caches = [torch.randn(4096, 2, block, heads, head, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    cache_ref = ti.PagedCacheRef(caches)
    rows_total = 8192
    src = torch.randn(layers, rows_total, 2, heads, head, dtype=torch.bfloat16, device=dev)
    rows = torch.randperm(rows_total, device=dev)[:tokens]
    slots = torch.randperm(4096 * block, device=dev)[:tokens]
    dist = torch.randint(0, 2000, (tokens,), device=dev)
    cos = torch.randn(131072, 64, device=dev)
    sin = torch.randn(131072, 64, device=dev)
    moved = 2 * layers * tokens * 2 * heads * head * 2  # read + write, bytes
    t_inject = do_bench(lambda: ti.inject(cache_ref, src, rows, slots, dist, cos, sin, head, True), warmup=50, rep=300, return_mode="median")
    host = src.cpu().contiguous()
    mapped = pin_host_tensor(host, dev)
    staging = torch.empty(layers, tokens, 2, heads, head, dtype=torch.bfloat16, device=dev)
    stage_rows = torch.arange(tokens, device=dev)
    host_bytes = layers * tokens * 2 * heads * head * 2
    micro = {"tokens": tokens, "layers": layers, "inject_hbm_ms": round(t_inject, 4), "inject_hbm_GBps": round(moved / t_inject / 1e6, 1)}
    if mapped is not None:
        t_copy = do_bench(lambda: ti.copy_rows(mapped, rows, staging, stage_rows), warmup=20, rep=300, return_mode="median")
        micro.update(host_rows_ms=round(t_copy, 4), host_rows_GBps=round(host_bytes / t_copy / 1e6, 1))
    else:
        micro["host_rows"] = "pinning failed"
    pinned = torch.empty(host_bytes // 2, dtype=torch.bfloat16).pin_memory()
    flat = torch.empty(host_bytes // 2, dtype=torch.bfloat16, device=dev)
    t_dma = do_bench(lambda: flat.copy_(pinned, non_blocking=True), warmup=20, rep=300, return_mode="median")
    micro.update(dma_same_bytes_ms=round(t_dma, 4), dma_GBps=round(host_bytes / t_dma / 1e6, 1))
    # host time of one launch (Python + driver), what each injecting step pays per kernel call
    def launch_us(fn, n: int = 200) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - started
        torch.cuda.synchronize()
        return round(elapsed / n * 1e6, 1)

    small = rows[:64], slots[:64], dist[:64]
    micro["launch_host_us"] = {
        "inject": launch_us(lambda: ti.inject(cache_ref, src, *small, cos, sin, head, True)),
        "inject_4_layers": launch_us(lambda: ti.inject(cache_ref, src, *small, cos, sin, head, True, 4, 4)),
        "copy_rows": launch_us(lambda: ti.copy_rows(src, small[0], staging, stage_rows[:64])),
        "torch_index_copy": launch_us(lambda: staging[0].index_copy_(0, stage_rows[:64], src[0].index_select(0, small[0]))),
    }
    result["micro"] = micro
    print("micro:", micro, flush=True)
    return result
