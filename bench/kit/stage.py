"""Staging and running: the repository's ignored staging folders, LoCoMo's path, and a bench's
parts each in a process of its own (a part that fails or runs out of time is recorded, and the
others still run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.kit.results import REPO, read_json, write_result

DATA = REPO / ".bench-data"  # ignored: LoCoMo-derived token ids (CC BY-NC, never committed)
GGUF_PARTS = REPO / ".bench-gguf"  # ignored: the SmolLM2 GGUF in two parts (one call each)
STAGE = REPO / ".serve-stage"  # ignored: what a GPU visit carries beside the checkout
LLAMA8B_CONFIG = REPO / "bench" / "engine" / "llama31_8b_config.json"
NO_LOCOMO = "LoCoMo data not given: set KVMEM_LOCOMO to its JSON (locomo10.json of snap-research/locomo, CC BY-NC 4.0)"
DEFAULT_LOCOMO = Path(os.environ["KVMEM_LOCOMO"]) if os.environ.get("KVMEM_LOCOMO") else None  # else --locomo is required


def locomo() -> Path:
    """LoCoMo's JSON ($KVMEM_LOCOMO); exits saying how to give it when it is not set."""
    return DEFAULT_LOCOMO or sys.exit(NO_LOCOMO)


def gpu_env() -> None:
    """The environment a vLLM bench on a GPU machine runs with (offline, the FlashInfer sampler off)."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with callables
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_part(module: str, part: str, argv: list[str], budget_s: float) -> int | str:
    """`python -m module --part part argv...` from the repository root, killed after `budget_s`;
    its return code or "timeout"."""
    started = time.perf_counter()
    try:
        rc: int | str = subprocess.run([sys.executable, "-m", module, "--part", part, *argv], cwd=REPO, timeout=budget_s).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    print(f"[bench] part {part}: rc {rc} in {time.perf_counter() - started:.0f} s", flush=True)
    return rc


def part_main(run: Callable[[], dict[str, Any]], path: Path) -> None:
    """Run one part in this process and write its result to `path`; on an exception keep what
    the part wrote so far, add the traceback as `error` and exit 1."""
    try:
        write_result(path, run())
    except Exception as exc:  # noqa: BLE001 - recorded; the orchestrator goes on
        traceback.print_exc()
        previous = read_json(path, {})
        previous["error"] = "".join(traceback.format_exception(exc))[-3000:]
        write_result(path, previous)
        sys.exit(1)


def load_parts(out: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each part's result (OUT/part_<name>.json), {} for a part that wrote none."""
    return {name: read_json(out / f"part_{name}.json", {}) for name in names}


def pip_download(requirement: str, folder: Path) -> list[Path]:
    """A wheel (no dependencies) downloaded into `folder` with this interpreter's pip."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder), requirement], check=True)
    return sorted(folder.glob("*.whl"))


def dump(payload: Any) -> str:
    return json.dumps(payload, indent=1, default=str)
