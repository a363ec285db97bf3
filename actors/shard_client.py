"""ShardClient: typed calls from an LLM replica to its MemoryShard Ray actor.

Every call the replica makes into the shard's process goes through one method here, one per
operation of memory.interface.MemoryInterface (which MemoryShard implements), with its names and
parameters (tests/test_memory_interface.py checks them), each bounded by a timeout. Ray wraps an
exception raised inside the actor; the client re-raises the shard's own exception (UnknownFact,
ArenaError, ...) so callers handle domain errors, not Ray's wrapper.

Chat plans, the one call on every chat request's path, go over the shard's plan channel when
the client has one (actors.plan_channel: a local socket, no Ray round trip), else through Ray.

Nothing waits for the shard without a deadline, and the shard drops what nobody waits for any
more (actors.shard_actor): each call carries its deadline (`call_deadline`), and a call the
client stopped waiting for is cancelled in Ray (ray.cancel: never run, never retried into a
restarted shard). Health probes go to the shard's probe concurrency group (actors.shard_actor.
PROBE_GROUP), never queued behind its other calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Sequence, TypeVar

import ray

from actors.plan_channel import PlanChannelTimeout, PlanClient, PlanExpired
from actors.shard_calls import PROBE_GROUP, CallExpired, ShardHealth
from memory.chat_query import ChatQuery
from memory.add_plan import AddBatch, AddCommit, AddPlan, AddResult
from memory.records import FactEvent, FactRecord
from memory.planner import ChatPlan
from memory.records import MemoryHit
from memory.kv_lifecycle import EncodeJob, EncodeOutcome

T = TypeVar("T")

logger = logging.getLogger(__name__)


class ShardTimeout(TimeoutError):
    """The shard did not answer within the client's timeout (restarting, or overloaded)."""


def unwrap_ray_error(exc: BaseException) -> BaseException:
    """The exception a Ray actor raised, out of Ray's RayTaskError wrapper."""
    return getattr(exc, "cause", None) or exc


class _InProcessMethod:
    def __init__(self, method: Any) -> None:
        self.method = method

    def options(self, **_: Any) -> "_InProcessMethod":
        return self  # one thread here: no concurrency groups

    async def remote(self, *args: Any, call_deadline: float | None = None) -> Any:
        return self.method(*args)  # in process, the caller is waiting by definition


class _InProcessActor:
    """A MemoryShard object behind the shape of a Ray actor handle (`handle.method.remote(...)`),
    so that tests and scripts drive an in-process shard through the same typed client."""

    def __init__(self, shard: Any) -> None:
        self._shard = shard

    def __getattr__(self, name: str) -> _InProcessMethod:
        return _InProcessMethod(getattr(self._shard, name))


class ShardClient:
    """Async, typed, time-bounded calls to one MemoryShard actor (see the module docstring)."""

    def __init__(self, actor: Any, timeout_s: float = 30.0, plan_channel: PlanClient | None = None, engine_slot: int = 0) -> None:
        self.actor = actor
        self.timeout_s = timeout_s
        self.plan_channel = plan_channel
        self.engine_slot = engine_slot  # the caller's engine among the shard's replicas (its encode jobs)

    @classmethod
    def in_process(cls, shard: Any, timeout_s: float = 300.0) -> "ShardClient":
        """A client over a MemoryShard object in this process (tests, benchmark scripts)."""
        return cls(_InProcessActor(shard), timeout_s)

    async def _call(self, method: Any, *args: Any, timeout_s: float | None = None) -> Any:
        """`method.remote(*args)` on the shard, within the timeout (ShardTimeout past it, and the
        call cancelled); the shard's own exception raised again here."""
        timeout = timeout_s or self.timeout_s
        call = method.remote(*args, call_deadline=time.time() + timeout)
        try:
            return await asyncio.wait_for(call, timeout)
        except asyncio.TimeoutError:
            _cancel(call)
            raise ShardTimeout(f"memory shard did not answer within {timeout:.0f} s") from None
        except Exception as exc:
            cause = unwrap_ray_error(exc)
            if isinstance(cause, CallExpired):  # it reached the shard too late: the same as no answer
                raise ShardTimeout(f"memory shard did not answer within {timeout:.0f} s ({cause})") from None
            if cause is exc:
                raise
            raise cause from None

    # ---------------------------------------------------------------- identity
    async def arena_path(self) -> str:
        return await self._call(self.actor.arena_path)

    async def ready(self) -> dict[str, Any]:
        return await self._call(self.actor.ready)

    async def stats(self) -> dict[str, Any]:
        return await self._call(self.actor.stats)

    # ---------------------------------------------------------------- writes
    async def prepare_add(self, batch: AddBatch) -> AddPlan:
        """An add's checks and reconcile candidates, in one round trip (memory.add_plan)."""
        return await self._call(self.actor.prepare_add, batch)

    async def commit_add(self, commit: AddCommit) -> AddResult:
        """An add's writes, in one round trip (memory.add_plan)."""
        return await self._call(self.actor.commit_add, commit)

    async def update(self, fact_id: str, user_id: str, text: str, metadata: dict[str, Any] | None = None) -> FactRecord:
        return await self._call(self.actor.update, fact_id, user_id, text, metadata)

    async def delete(self, fact_id: str, user_id: str) -> FactRecord:
        return await self._call(self.actor.delete, fact_id, user_id)

    async def delete_all(self, user_id: str) -> int:
        return await self._call(self.actor.delete_all, user_id)

    # ---------------------------------------------------------------- reads
    async def get(self, fact_id: str, user_id: str) -> FactRecord:
        return await self._call(self.actor.get, fact_id, user_id)

    async def get_all(self, user_id: str) -> list[FactRecord]:
        return await self._call(self.actor.get_all, user_id)

    async def history(self, fact_id: str, user_id: str) -> list[FactEvent]:
        return await self._call(self.actor.history, fact_id, user_id)

    async def search(self, user_id: str, query: str, top_k: int) -> list[MemoryHit]:
        return await self._call(self.actor.search, user_id, query, top_k)

    async def plan_chat(self, query: ChatQuery) -> ChatPlan:
        """The shard's plan for a chat, over the plan channel when there is one (ShardTimeout when
        it does not answer in time: not asked again through Ray, module docstring)."""
        if self.plan_channel is None:
            return await self._call(self.actor.plan_chat, query)
        try:
            return await self.plan_channel.plan(query)
        except (PlanChannelTimeout, PlanExpired) as exc:
            raise ShardTimeout(f"memory shard did not plan in time: {exc}") from None

    # ---------------------------------------------------------------- encoding (memory.kv_lifecycle)
    async def take_encode_jobs(self, max_jobs: int | None = None, engine_slot: int | None = None) -> list[EncodeJob]:
        slot = self.engine_slot if engine_slot is None else engine_slot
        return await self._call(self.actor.take_encode_jobs, max_jobs, slot)

    async def complete_encode_jobs(self, outcomes: dict[str, EncodeOutcome]) -> int:
        return await self._call(self.actor.complete_encode_jobs, outcomes)

    async def encode_pending(self, fact_ids: Sequence[str]) -> list[str]:
        return await self._call(self.actor.encode_pending, list(fact_ids))

    async def health(self, timeout_s: float | None = None) -> ShardHealth:
        """A probe in the shard's probe group: answered at once, whatever its other calls are doing."""
        return await self._call(self.actor.health.options(concurrency_group=PROBE_GROUP), timeout_s=timeout_s)


def _cancel(call: Any) -> None:
    """Cancel a Ray call nobody waits for any more (not run if it has not started, never retried)."""
    try:
        if isinstance(call, ray.ObjectRef):
            ray.cancel(call, recursive=False)
    except Exception as exc:  # noqa: BLE001 - the call's deadline sheds it in the shard anyway
        logger.debug("could not cancel a shard call: %s", exc)
