"""Starting the real service for HTTP tests: Ray, Ray Serve and the app with small CPU settings.

One function, used by the module-scoped fixtures of the HTTP test modules, so each module runs
the service the way `serve run` does (serve_app.app.build_app) with only what it needs changed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from devtools.local_redis import free_loopback_port


def small_service_args(redis_url: str, model_dir: Path, namespace: str, arena_dir: str, **overrides: Any) -> dict[str, Any]:
    """ServiceSettings args for tests: SmolLM2 in the service's own dtype (auto: float32 on CPUs
    without native bf16, where bf16 runs torch's scalar GEMM at ~1 generated token/s; bf16
    elsewhere), short context, exact index on the CPU.

    Every test module shares one Redis server, so each service writes under its own key prefix
    (`kvmem-<namespace>`): a shard rebuilds its users from Redis at start, and must not adopt
    facts another module left behind."""
    args: dict[str, Any] = {
        "redis_url": redis_url,
        "engine": {"model": str(model_dir), "dtype": "auto", "max_model_len": 1024, "cpu_kv_cache_space_gib": 1},
        "default_max_tokens": 32,
        "llm_replicas": 1,
        "llm_replica_num_cpus": 0,
        "namespace": namespace,
        # admission on, but out of the way of tests about something else (tests/test_hostile_serve.py sets its own)
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
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(args.get(key), dict):
            args[key] = {**args[key], **value}
        else:
            args[key] = value
    return args


@contextmanager
def running_service(redis_url: str, model_dir: Path, namespace: str, metrics: bool = False, **overrides: Any) -> Iterator[str]:
    """The app served on a free loopback port; yields its base URL, shuts Ray down after."""
    import ray
    from ray import serve

    from serve_app.app import build_app

    from serve_app.ingress.proxy_guard import CALLBACK, CALLBACK_VARIABLE

    port = free_loopback_port()
    arena_dir = tempfile.mkdtemp(prefix=f"kvmem-{namespace}-", dir="/dev/shm")
    os.environ.setdefault(CALLBACK_VARIABLE, CALLBACK)  # Serve's proxy loads the connection bounds, as scripts/serve.sh has it
    init: dict[str, Any] = {"num_cpus": 2, "include_dashboard": False, "runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1"}}}
    if metrics:
        metrics_port = free_loopback_port()
        init["_metrics_export_port"] = metrics_port
        os.environ["KVMEM_TEST_METRICS_URL"] = f"http://127.0.0.1:{metrics_port}/metrics"
    ray.init(**init)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port, "keep_alive_timeout_s": 15})
        serve.run(build_app(small_service_args(redis_url, model_dir, namespace, arena_dir, **overrides)), name="kvmem", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(arena_dir, ignore_errors=True)
