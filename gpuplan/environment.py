"""The environment every GPU-side process of the service starts with: no library pools GPU memory
it was not given.

One constant, SERVICE_GPU_ENV, set by the service itself (Ray runtime_env env_vars) on its LLM
replicas (and so on vLLM's engine-core subprocess, which inherits the replica's environment) and
on its memory shard actors, never left to the user's shell:

- JAX preallocates 75% of the card when it first touches a GPU (measured on an H100: the shard
  went from 0.6 to 60 GiB one second into its start, because bm25s imports jax when it is
  installed). JAX_PLATFORMS=cpu keeps JAX off the GPU; XLA_PYTHON_CLIENT_PREALLOCATE=false
  also turns the preallocation off should a user's JAX_PLATFORMS put it back on the GPU.
- TensorFlow maps nearly all of the card at its first GPU op; TF_FORCE_GPU_ALLOW_GROWTH=true
  makes it grow on demand.
- RMM (what cuVS allocates through) uses a plain cudaMalloc resource unless a pool is installed
  (rmm.mr.set_current_device_resource, cuvsRMMPoolMemoryResourceEnable): nothing here installs
  one, so there is nothing to turn off; its default is documented in docs/gpu.md.
- CuPy keeps freed blocks in a pool that grows on demand (it preallocates nothing);
  CUPY_GPU_MEMORY_LIMIT caps it. Its value depends on the memory plan, so the replica sets it on
  the shard it starts (shard_env_vars), not here.
- torch's caching allocator also grows on demand; vLLM sizes its own use by
  gpu_memory_utilization (the memory plan's engine share).

A variable the user set explicitly in the environment the application is built in wins
(gpu_env_vars): who sets JAX_PLATFORMS=cuda means it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SERVICE_GPU_ENV: dict[str, str] = {
    "JAX_PLATFORMS": "cpu",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    "TF_FORCE_GPU_ALLOW_GROWTH": "true",
}

CUPY_LIMIT = "CUPY_GPU_MEMORY_LIMIT"  # bytes (or a percentage) CuPy's pool may hold on each device


def gpu_env_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """SERVICE_GPU_ENV, with the value of each variable the environment already sets explicitly."""
    environ = os.environ if environ is None else environ
    return {name: environ.get(name) or default for name, default in SERVICE_GPU_ENV.items()}


def shard_env_vars(shard_bytes: int | None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A memory shard's environment: gpu_env_vars plus, when the memory plan gives the shard a share
    of the card, CuPy's pool capped at that share (a user's own CUPY_GPU_MEMORY_LIMIT wins)."""
    environ = os.environ if environ is None else environ
    env = gpu_env_vars(environ)
    if environ.get(CUPY_LIMIT):
        env[CUPY_LIMIT] = environ[CUPY_LIMIT]
    elif shard_bytes:
        env[CUPY_LIMIT] = str(int(shard_bytes))
    return env
