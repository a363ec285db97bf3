"""Starting (or finding) the MemoryShard Ray actor that sits beside its shard's engines.

The shard must share a host with its engines (the arena is shared memory), so it is pinned to
the caller's node. It is detached: it outlives any one LLM replica (a shard may be served by
several replicas, `llm_replicas_per_shard`, and a replica's death must not take the shard's
index and encode queue with it), and it ends itself once no replica has called it for
`orphan_timeout_s` (ShardLease), so a deleted application leaves no shard behind for long. A
replica that finds a shard started with other settings (a new deployment) replaces it
(serve_app.replica.lifecycle).

Ray restarts it when its process dies (max_restarts=-1) and retries the calls that were in
flight (max_task_retries=-1); every shard method that writes is idempotent (fact records are
de-duplicated in Redis), so a retried call makes no duplicates.

What nobody waits for any more is shed, so a restarting or overloaded shard does not replay a
backlog its callers gave up on (issue 34: under 50 closed-loop users a killed shard came back to
a queue of plans, probes, encode polls and adds whose callers had left, and never caught up):
- every call carries its caller's deadline (`call_deadline`, wall-clock seconds; the shard runs
  on its callers' host) and a call that reaches the lock after it raises CallExpired at once;
  the client also cancels a call it stopped waiting for (ray.cancel), so Ray never runs it;
- the plan channel's server drops a plan whose deadline passed (actors.plan_channel);
- health probes run in a concurrency group of their own and take no lock: a probe answers at once
  with what the shard is doing (ShardHealth: which call holds the lock, for how long), so the
  replica's watchdog tells a busy shard from a wedged one instead of waiting behind the queue.

Calls other than the probes run one at a time (the default concurrency group has one thread,
and one lock makes the plan channel's plans and Ray's calls take turns), in the order they
arrive (not the order they were sent: see allow_out_of_order_execution).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import threading
import time
from typing import Any, Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from redis.exceptions import OutOfMemoryError, RedisError

from actors.plan_channel import PlanServer, plan_channel_address
from actors.shard_calls import PROBE_GROUP, CallExpired, ShardHealth
from gpuplan.environment import gpu_env_vars
from memory.chat_query import ChatQuery
from memory.planner import ChatPlan
from memory.records import StoreFull, StoreUnavailable
from memory.settings import MemorySettings
from memory.shard import MemoryShard

logger = logging.getLogger(__name__)


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
    "lifetime": "detached",
}
SHARD_ACTOR_GROUPS: dict[str, int] = {PROBE_GROUP: 1}  # concurrency groups: set by ray.remote(), not .options()

UNLOCKED = frozenset({"health", "ready"})  # answered at once, outside the lock (module docstring)


class ShardLease:
    """Ends the (detached) shard actor once nobody has called it for `timeout_s`: its replicas are
    gone for good (the application was deleted). 0: never."""

    def __init__(self, timeout_s: float, on_expiry: Callable[[], None], period_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self.on_expiry = on_expiry
        self.period_s = period_s
        self.last_call = time.monotonic()
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="kvmem-shard-lease", daemon=True).start()

    def touch(self) -> None:
        self.last_call = time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(min(self.period_s, self.timeout_s))
            idle = time.monotonic() - self.last_call
            if idle > self.timeout_s:
                logger.warning("no replica has called this shard for %.0f s: it ends", idle)
                self.on_expiry()
                return


def shard_call(method: Callable[..., Any]) -> Callable[..., Any]:
    """The method under the shard's lock, shed when its caller's deadline has passed; a Redis error
    leaves the actor as StoreUnavailable, which the ingress answers 503 with Retry-After (the
    caller need not know redis-py's exceptions), or as StoreFull when Redis refused a write for
    memory (507)."""

    @functools.wraps(method)
    def locked(self: "ShardActor", *args: Any, call_deadline: float | None = None, **kwargs: Any) -> Any:
        self.lease.touch()
        with self.lock:
            if call_deadline is not None and time.time() > call_deadline:
                self.shed_calls += 1
                raise CallExpired(f"{method.__name__} reached the shard {time.time() - call_deadline:.1f} s after its caller gave up")
            outer, self.busy = self.busy, (method.__name__, time.monotonic())  # a shard method may call another
            try:
                return method(self, *args, **kwargs)
            except OutOfMemoryError as exc:  # maxmemory, noeviction: the refused transaction changed nothing
                raise StoreFull(f"the memory store (Redis) is full and refused the write: {exc}") from None
            except RedisError as exc:
                raise StoreUnavailable(f"memory store (Redis) unavailable: {type(exc).__name__}: {exc}") from None
            finally:
                self.busy = outer

    # Ray checks a call's arguments in the caller against the signature of the function it finds
    # by unwrapping (inspect.unwrap): no __wrapped__, and a signature that says call_deadline
    del locked.__wrapped__  # type: ignore[attr-defined]
    locked.shard_method = method  # type: ignore[attr-defined]
    signature = inspect.signature(method)
    deadline = inspect.Parameter("call_deadline", inspect.Parameter.KEYWORD_ONLY, default=None)
    params = list(signature.parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind == p.VAR_KEYWORD), len(params))
    locked.__signature__ = signature.replace(parameters=params[:at] + [deadline] + params[at:])  # type: ignore[attr-defined]
    return locked


class ShardActor(MemoryShard):
    """A MemoryShard whose every public method runs under `lock` (but the probes), serving chat
    plans on its plan channel too (module docstring). Ray runs this class; tests and scripts may
    run a plain MemoryShard in-process."""

    def __init__(self, *args: Any, fingerprint: str = "", orphan_timeout_s: float = 0.0, **kwargs: Any) -> None:
        self.lock = threading.RLock()  # re-entrant: a locked method may call another (stats calls pending_encodes)
        self.busy: tuple[str, float] | None = None  # (method, since) while a call holds the lock
        self.shed_calls = 0
        self.fingerprint = fingerprint  # the settings this shard was started with (start_shard_actor)
        self.lease = ShardLease(0.0, lambda: None)  # the real one once loaded: loading is no idleness
        with self.lock:
            super().__init__(*args, **kwargs)
        self.plan_server = PlanServer(self._plan, plan_channel_address(self.arena_path()), self.lock).start()
        self.lease = ShardLease(orphan_timeout_s, self._end)

    def _plan(self, query: ChatQuery) -> ChatPlan:
        self.lease.touch()
        self.busy = ("plan_chat", time.monotonic())
        try:
            return MemoryShard.plan_chat(self, query)  # the lock is the plan server's (PlanServer)
        finally:
            self.busy = None

    def _end(self) -> None:
        self.plan_server.close()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # ------------------------------------------------------------------ probes (no lock)
    def ready(self, call_deadline: float | None = None) -> dict[str, Any]:
        """Identity and size; `call_deadline` is accepted as every call's, and needs no shedding here."""
        self.lease.touch()
        return {**MemoryShard.ready(self), "fingerprint": self.fingerprint}

    def health(self, call_deadline: float | None = None) -> ShardHealth:
        """What the shard is doing now, without its lock: which call holds it and for how long,
        whether the plan channel still serves, whether Redis answers (a short ping)."""
        self.lease.touch()
        busy = self.busy
        busy_with, busy_s = (busy[0], time.monotonic() - busy[1]) if busy else (None, 0.0)
        status = "ok" if self.plan_server.serving() else "plan channel stopped"
        if status == "ok":
            status = MemoryShard.health(self)
        return ShardHealth(status=status, busy_with=busy_with, busy_s=busy_s, shed_calls=self.shed_calls)

    def stats(self) -> dict[str, Any]:
        """MemoryShard.stats plus what was shed: calls and plans whose callers had given up."""
        return {**MemoryShard.stats(self), "calls_shed": self.shed_calls, "plans_expired": self.plan_server.expired}


# Every public method of MemoryShard (or ShardActor's own version of it), wrapped here rather than
# written out: a method added to the shard later is serialized with the plan channel without anyone
# having to remember it.
for _name, _method in inspect.getmembers(MemoryShard, inspect.isfunction):
    if not _name.startswith("_") and _name not in UNLOCKED:
        setattr(ShardActor, _name, shard_call(vars(ShardActor).get(_name, _method)))


def shard_actor_name(namespace: str, shard_id: int) -> str:
    return f"kvmem-shard-{namespace}-{shard_id}"


def shard_fingerprint(settings: MemorySettings, model_dir: str, kv_dtype: str, redis_url: str, namespace: str) -> str:
    """What a running shard must have been started with for a replica to use it (ShardActor.ready)."""
    given = {"settings": settings.model_dump(mode="json"), "model": model_dir, "kv_dtype": kv_dtype, "redis": redis_url, "ns": namespace}
    return hashlib.sha256(json.dumps(given, sort_keys=True).encode()).hexdigest()[:16]


def start_shard_actor(
    shard_id: int,
    settings: MemorySettings,
    model_dir: str,
    kv_dtype: str,
    redis_url: str,
    namespace: str = "default",
    num_gpus: float = 0.0,
    redis_password: str | None = None,
    orphan_timeout_s: float = 0.0,
    env_vars: dict[str, str] | None = None,
) -> Any:
    """The shard's actor handle (created on this node unless it already runs). Its environment keeps
    JAX, TensorFlow and CuPy from pooling the card (gpuplan.environment; `env_vars`: the replica's
    memory plan's, with CuPy capped at the shard's share)."""
    actor = ray.remote(concurrency_groups=SHARD_ACTOR_GROUPS)(ShardActor).options(
        name=shard_actor_name(namespace, shard_id),
        get_if_exists=True,
        **SHARD_ACTOR_OPTIONS,
        num_gpus=num_gpus,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env_vars or gpu_env_vars())}},
    )
    return actor.remote(
        shard_id, settings, model_dir, kv_dtype, redis_url, namespace, redis_password,
        fingerprint=shard_fingerprint(settings, model_dir, kv_dtype, redis_url, namespace), orphan_timeout_s=orphan_timeout_s,
    )  # fmt: skip
