"""Starting the real service for a bench (and for the HTTP tests, tests/serve_harness.py).

`running_service`: Ray, Ray Serve and the app in this process with small CPU settings, the way
`serve run` builds it (serve_app.app.build_app) with only what a run needs changed;
`cpu_service`: the same over a local Redis and the staged SmolLM2, what the CPU benches start.
The GPU service (`serve run config.gpu.yaml` in a process of its own) is `ServeRun`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.kit.results import REPO
from devtools.local_redis import free_loopback_port


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides`: a dict value merged one level down, anything else replaced."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def small_service_args(redis_url: str, model_dir: Path, namespace: str, arena_dir: str, **overrides: Any) -> dict[str, Any]:
    """ServiceSettings args for a small CPU service: SmolLM2 in the service's own dtype (auto:
    float32 on CPUs without native bf16, where bf16 runs torch's scalar GEMM at ~1 generated
    token/s; bf16 elsewhere), short context, exact index on the CPU.

    Services that share one Redis server each write under their own key prefix
    (`kvmem-<namespace>`): a shard rebuilds its users from Redis at start, and must not adopt
    facts another service left behind."""
    args: dict[str, Any] = {
        "redis_url": redis_url,
        "engine": {"model": str(model_dir), "dtype": "auto", "max_model_len": 1024, "cpu_kv_cache_space_gib": 1},
        "default_max_tokens": 32,
        "llm_replicas": 1,
        "llm_replica_num_cpus": 0,
        "namespace": namespace,
        # admission on, but out of the way of runs about something else (tests/test_hostile_serve.py sets its own)
        "admission": {"per_user": {kind: {"per_s": 1000, "burst": 1000} for kind in ("chats", "writes", "reads")},
                      "max_engine_requests_per_key": 64, "max_writes_per_key": 64, "refusal_hold_s": 0},
        "memory": {
            "window_turns": 2,
            "encode_neighbours": 2,  # short encode prompts, like the window: 2 CPU cores serve every test
            "arena_dir": arena_dir,
            "redis_prefix": f"kvmem-{namespace}",
            "index": {"backend": "exact", "device": "cpu"},
        },
    }
    return merged(args, overrides)


def config_args(config: str = "config.yaml") -> dict[str, Any]:
    """The `args` of a Serve config's application (the settings `serve run` gives the service)."""
    import yaml

    (app,) = yaml.safe_load((REPO / config).read_text())["applications"]
    return app["args"]


@contextmanager
def serve_in_process(settings: dict[str, Any], num_cpus: int = 2, metrics: bool = False,
                     http_options: dict[str, Any] | None = None) -> Iterator[str]:
    """Ray, Serve and the app with these ServiceSettings args in this process, on a free loopback
    port; yields its base URL, shuts Ray down after."""
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.ingress.proxy_guard import CALLBACK, CALLBACK_VARIABLE

    port = free_loopback_port()
    os.environ.setdefault(CALLBACK_VARIABLE, CALLBACK)  # Serve's proxy loads the connection bounds, as scripts/serve.sh has it
    init: dict[str, Any] = {"num_cpus": num_cpus, "include_dashboard": False, "runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1"}}}
    if metrics:
        metrics_port = free_loopback_port()
        init["_metrics_export_port"] = metrics_port
        os.environ["KVMEM_TEST_METRICS_URL"] = f"http://127.0.0.1:{metrics_port}/metrics"
    ray.init(**init)
    try:
        serve.start(http_options={"keep_alive_timeout_s": 15, **(http_options or {}), "host": "127.0.0.1", "port": port})
        serve.run(build_app(settings), name="kvmem", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def running_service(redis_url: str, model_dir: Path, namespace: str, metrics: bool = False, **overrides: Any) -> Iterator[str]:
    """The app with small_service_args served on a free loopback port; yields its base URL."""
    arena_dir = tempfile.mkdtemp(prefix=f"kvmem-{namespace}-", dir="/dev/shm")
    try:
        with serve_in_process(small_service_args(redis_url, model_dir, namespace, arena_dir, **overrides), metrics=metrics) as url:
            yield url
    finally:
        shutil.rmtree(arena_dir, ignore_errors=True)


@contextmanager
def cpu_service(namespace: str, **overrides: Any) -> Iterator[str]:
    """`running_service` over a fresh local Redis and the staged SmolLM2; yields the base URL."""
    from devtools.local_redis import LocalRedis
    from devtools.offline_models import prepare_smollm2

    with tempfile.TemporaryDirectory() as folder, LocalRedis(Path(folder) / "redis") as redis:
        with running_service(redis.url, prepare_smollm2(), namespace, **overrides) as url:
            yield url


def cpu_dtype() -> str:
    """What the service's dtype "auto" resolves to on this CPU."""
    from serve_app.replica.engine import cpu_has_native_bf16

    return "bfloat16" if cpu_has_native_bf16() else "float32"
