"""The injection kernels on the GPU (part `smoke` of bench/engine/engine_ttft.py): the Triton kernel
tests compiled, not interpreted (docs/bench.md). Its micro-timings at the Llama-3.1-8B shape were
retired in issue 35 (last at 631086d; docs/gpu.md cites them with that commit)."""

from __future__ import annotations

import subprocess
import sys

from bench.kit.results import REPO


def run(args) -> dict:
    """The card, the versions and the kernel tests' result."""
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
    return result
