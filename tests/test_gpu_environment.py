"""The environment that keeps JAX, TensorFlow and CuPy from pooling the card (gpuplan.environment), as the
service sets it on its LLM replicas (Serve deployments' ray_actor_options) and its shard actors
(start_shard_actor's runtime_env), checked without starting Ray; bm25s imported without JAX; and the
host tier's pages allocated ahead of the engine's pin (serve_app.replica.startup.commit_host_tier).

Issue 34: on an H100 the shard went from 0.6 to 60 GiB one second into its start (bm25s imports
jax when installed; JAX preallocates 75% of the card), and vLLM then refused to start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from ray.serve._private import deploy_utils
from ray.serve._private.build_app import build_app as build_serve_app

from gpuplan.environment import CUPY_LIMIT, SERVICE_GPU_ENV, gpu_env_vars, shard_env_vars

REPO = Path(__file__).resolve().parent.parent
EXPECTED = {"JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*SERVICE_GPU_ENV, CUPY_LIMIT, *(n for n in os.environ if n.upper().startswith("KVMEM_"))]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # never connected to
    context = types.SimpleNamespace(get_job_id=lambda: "01000000")
    monkeypatch.setattr(deploy_utils, "ray", types.SimpleNamespace(get_runtime_context=lambda: context))


def test_the_service_environment_and_a_users_explicit_value(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert SERVICE_GPU_ENV == EXPECTED and gpu_env_vars() == EXPECTED
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")  # who says so means it
    assert gpu_env_vars()["JAX_PLATFORMS"] == "cuda" and gpu_env_vars()["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert shard_env_vars(None) == gpu_env_vars()  # no plan: no CuPy cap
    assert shard_env_vars(3 * 2**30)[CUPY_LIMIT] == str(3 * 2**30)  # the shard's share of the plan
    monkeypatch.setenv(CUPY_LIMIT, "10%")
    assert shard_env_vars(3 * 2**30)[CUPY_LIMIT] == "10%"


@pytest.mark.parametrize("routing", ["router", "direct"])
def test_every_llm_replica_deployment_carries_the_environment(routing: str, clean_env: None) -> None:
    """build_app as `serve run` builds it: each LLM replica's ray_actor_options.runtime_env has the
    variables (vLLM's engine core inherits the replica's environment); the router carries none."""
    from serve_app.app import build_app

    built = build_serve_app(build_app({"llm_replicas": 2, "routing": routing, "llm_replica_num_gpus": 0.9, "shard_num_gpus": 0.1}), name="kvmem")
    options = {d.name: d.ray_actor_options for d in built.deployments}
    replicas = [name for name in options if name.startswith("LLMReplica")]
    assert replicas == (["LLMReplica"] if routing == "direct" else ["LLMReplica_0", "LLMReplica_1"])
    for name in replicas:
        assert options[name]["runtime_env"] == {"env_vars": EXPECTED}, name
        assert options[name]["num_gpus"] == 0.9
    assert "runtime_env" not in options.get("ChatAPI", {})
    # a replica whose start fails (a plan that does not fit) is tried once, not 3 times, before DEPLOY_FAILED
    attempts = {d.name: d._deployment_config.max_constructor_retry_count for d in built.deployments if d.name in replicas}
    assert attempts == ({"LLMReplica": 2} if routing == "direct" else {"LLMReplica_0": 1, "LLMReplica_1": 1})


def test_the_shard_actor_is_started_with_the_environment(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """start_shard_actor's Ray options, captured without starting Ray."""
    import ray

    from actors import shard_actor
    from memory.settings import MemorySettings

    captured: dict = {}

    class Remote:
        def __call__(self, cls):  # ray.remote(concurrency_groups=...)(ShardActor)
            return self

        def options(self, **kwargs):
            captured.update(kwargs)
            return types.SimpleNamespace(remote=lambda *args, **kwargs: ("handle", args))

    monkeypatch.setattr(ray, "remote", lambda *cls, **groups: Remote())
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(get_node_id=lambda: "ab" * 28))
    shard_actor.start_shard_actor(0, MemorySettings(), "/m", "bfloat16", "redis://127.0.0.1:1/0", "ns", 0.1)
    env = captured["runtime_env"]["env_vars"]
    assert {k: env[k] for k in EXPECTED} == EXPECTED and env["HF_HUB_OFFLINE"] == "1"
    assert captured["num_gpus"] == 0.1 and captured["name"] == "kvmem-shard-ns-0"
    shard_actor.start_shard_actor(0, MemorySettings(), "/m", "bfloat16", "redis://x", "ns", 0.1, env_vars=shard_env_vars(2**30))
    assert captured["runtime_env"]["env_vars"][CUPY_LIMIT] == str(2**30)  # what the replica's plan gives it


def test_the_replica_sets_what_its_process_lacks(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Serve `deployments:` entry replaces the builder's ray_actor_options whole: the replica's
    constructor (ReplicaStart) still sets the variables before its engine core starts."""
    from serve_app.replica.startup import ReplicaStart

    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "false")  # explicit: kept
    ReplicaStart()
    assert os.environ["JAX_PLATFORMS"] == "cpu" and os.environ["TF_FORCE_GPU_ALLOW_GROWTH"] == "false"


def test_the_keyword_index_never_imports_jax(tmp_path: Path) -> None:
    """A JAX installed beside the service is not imported by bm25s (bm25s/selection.py imports jax.lax
    and runs a top-k at import): a stand-in `jax` package that records being imported stays unimported."""
    fake = tmp_path / "jax"
    fake.mkdir()
    (fake / "__init__.py").write_text("import os\nopen(os.environ['JAX_MARKER'], 'w').write('imported')\n")
    (fake / "lax.py").write_text("def top_k(x, k):\n    return x, x\n")
    marker = tmp_path / "marker"
    probe = textwrap.dedent("""
        import sys
        import importlib.util
        assert importlib.util.find_spec("jax") is not None  # the stand-in is importable
        from memory.index.keyword import KeywordIndex
        index = KeywordIndex()
        index.add(["f1"], ["u1"], ["Caroline adopted a dog named Rex"])
        assert [h.fact_id for h in index.search("u1", "dog", 5)] == ["f1"]
        import bm25s.selection
        print("jax" in sys.modules, bm25s.selection.JAX_IS_AVAILABLE)
    """)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}", "JAX_MARKER": str(marker)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"] and not marker.exists()


def test_the_host_tier_is_allocated_ahead_of_the_pin(tmp_path) -> None:
    """commit_host_tier turns the arena's sparse kv.bin into allocated pages, contents unchanged (zeros)."""
    from serve_app.replica.startup import commit_host_tier

    kv = tmp_path / "kv.bin"
    with open(kv, "wb") as f:
        f.truncate(8 << 20)  # sparse, as kvarena.arena.FactArena.create makes it
    assert os.stat(kv).st_blocks * 512 < (8 << 20)
    assert commit_host_tier(kv) is not None
    assert os.stat(kv).st_blocks * 512 >= (8 << 20) and os.stat(kv).st_size == 8 << 20
    assert kv.read_bytes() == bytes(8 << 20)
    assert commit_host_tier(tmp_path / "missing.bin") is None  # a failure is a warning, not a failed start
