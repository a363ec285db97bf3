"""Starting (or finding) the MemoryShard Ray actor that sits beside one engine.

The shard must share a host with its engine (the arena is shared memory), so it is pinned to
the caller's node. Ray restarts it when it dies (max_restarts=-1) and retries the calls that
were in flight (max_task_retries=-1); every shard method that writes is idempotent (fact
records are de-duplicated in Redis), so a retried call makes no duplicates. Calls run one at a
time, in the order they arrive (not the order they were sent: see allow_out_of_order_execution).

The actor is a ShardActor: the MemoryShard plus its plan channel (actors.plan_channel), a thread
that answers chat plans without a Ray round trip. One lock makes the channel's plans and Ray's
calls take turns, so the shard still runs one call at a time.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable

from redis.exceptions import OutOfMemoryError, RedisError

from actors.plan_channel import PlanServer, plan_channel_address
from gpuplan.environment import gpu_env_vars
from memory.chat_query import ChatQuery
from memory.planner import ChatPlan
from memory.records import StoreFull, StoreUnavailable
from memory.settings import MemorySettings
from memory.shard import MemoryShard


# Restarted when its process dies, its in-flight calls retried; calls run as they arrive.
# No head-of-line blocking: with in-order execution a call that never reaches the actor (Serve
# cancels a disconnected client's request, and Ray cancels the shard calls it made with it) left
# every later call of that replica waiting in PENDING_ACTOR_TASK_ORDERING_OR_CONCURRENCY for good
# (seen on the H200 after Locust runs; tests/test_shard_actor_ordering.py reproduces it on CPU).
# Nothing relies on the order: a replica awaits each call before one that depends on it, and the
# shard runs one call at a time either way.
SHARD_ACTOR_OPTIONS: dict[str, Any] = {
    "max_restarts": -1,
    "max_task_retries": -1,
    "allow_out_of_order_execution": True,
    "num_cpus": 0,
}


def _one_at_a_time(method: Callable[..., Any]) -> Callable[..., Any]:
    """The method under the shard's lock; a Redis error leaves the actor as StoreUnavailable, which
    the ingress answers 503 with Retry-After (the caller need not know redis-py's exceptions), or as
    StoreFull when Redis refused a write for memory (507)."""

    @functools.wraps(method)
    def locked(self: "ShardActor", *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            try:
                return method(self, *args, **kwargs)
            except OutOfMemoryError as exc:  # maxmemory, noeviction: the refused transaction changed nothing
                raise StoreFull(f"the memory store (Redis) is full and refused the write: {exc}") from None
            except RedisError as exc:
                raise StoreUnavailable(f"memory store (Redis) unavailable: {type(exc).__name__}: {exc}") from None

    return locked


class ShardActor(MemoryShard):
    """A MemoryShard whose every public method runs under `lock`, serving chat plans on its
    plan channel too (module docstring). Ray runs this class; tests and scripts may run a plain
    MemoryShard in-process."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.lock = threading.RLock()  # re-entrant: plan_chat calls search
        with self.lock:
            super().__init__(*args, **kwargs)
        self.plan_server = PlanServer(self._plan, plan_channel_address(self.arena_path()), self.lock).start()

    def _plan(self, query: ChatQuery) -> ChatPlan:
        return MemoryShard.plan_chat(self, query)  # the lock is the plan server's (PlanServer)


# Every public method of MemoryShard, wrapped here rather than written out: a method added to the
# shard later is serialized with the plan channel without anyone having to remember it.
for _name, _method in inspect.getmembers(MemoryShard, inspect.isfunction):
    if not _name.startswith("_"):
        setattr(ShardActor, _name, _one_at_a_time(_method))


def shard_actor_name(namespace: str, shard_id: int) -> str:
    return f"kvmem-shard-{namespace}-{shard_id}"


def start_shard_actor(
    shard_id: int,
    settings: MemorySettings,
    model_dir: str,
    kv_dtype: str,
    redis_url: str,
    namespace: str = "default",
    num_gpus: float = 0.0,
    redis_password: str | None = None,
    env_vars: dict[str, str] | None = None,
) -> Any:
    """The shard's actor handle (created on this node unless it already runs). Its environment keeps
    JAX, TensorFlow and CuPy from pooling the card (gpuplan.environment; `env_vars`: the replica's
    memory plan's, with CuPy capped at the shard's share)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(ShardActor).options(
        name=shard_actor_name(namespace, shard_id),
        get_if_exists=True,
        **SHARD_ACTOR_OPTIONS,
        num_gpus=num_gpus,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env_vars or gpu_env_vars())}},
    )
    return actor.remote(shard_id, settings, model_dir, kv_dtype, redis_url, namespace, redis_password)
