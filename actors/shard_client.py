"""ShardClient: typed calls from an LLM replica to its MemoryShard Ray actor.

Every call the replica makes into the shard's process goes through one method here, named and
typed like the shard's own (memory.shard.MemoryShard), each bounded by a timeout. Ray wraps an
exception raised inside the actor; the client re-raises the shard's own exception (UnknownFact,
ArenaError, ...) so callers handle domain errors, not Ray's wrapper.

Chat plans, the one call on every chat request's path, go over the shard's plan channel when
the client has one (actors.plan_channel: a local socket, no Ray round trip); when the channel
does not answer in time (the shard restarting), the plan is asked for through Ray instead.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Sequence, TypeVar

from actors.plan_channel import PlanChannelTimeout, PlanClient
from memory.chat_query import ChatQuery
from memory.records import FactEvent, FactRecord, NewFact, Turn
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

    async def remote(self, *args: Any) -> Any:
        return self.method(*args)


class _InProcessActor:
    """A MemoryShard object behind the shape of a Ray actor handle (`handle.method.remote(...)`),
    so that tests and scripts drive an in-process shard through the same typed client."""

    def __init__(self, shard: Any) -> None:
        self._shard = shard

    def __getattr__(self, name: str) -> _InProcessMethod:
        return _InProcessMethod(getattr(self._shard, name))


class ShardClient:
    """Async, typed, time-bounded calls to one MemoryShard actor (see the module docstring)."""

    def __init__(self, actor: Any, timeout_s: float = 30.0, plan_channel: PlanClient | None = None) -> None:
        self.actor = actor
        self.timeout_s = timeout_s
        self.plan_channel = plan_channel
        self.plans_over_ray = 0  # plans the channel did not answer in time, asked for through Ray

    @classmethod
    def in_process(cls, shard: Any, timeout_s: float = 300.0) -> "ShardClient":
        """A client over a MemoryShard object in this process (tests, benchmark scripts)."""
        return cls(_InProcessActor(shard), timeout_s)

    async def _wait(self, call: Awaitable[T], timeout_s: float | None = None) -> T:
        try:
            return await asyncio.wait_for(call, timeout_s or self.timeout_s)
        except asyncio.TimeoutError:
            raise ShardTimeout(f"memory shard did not answer within {timeout_s or self.timeout_s:.0f} s") from None
        except Exception as exc:
            cause = unwrap_ray_error(exc)
            if cause is exc:
                raise
            raise cause from None

    # ---------------------------------------------------------------- identity
    async def arena_path(self) -> str:
        return await self._wait(self.actor.arena_path.remote())

    async def ready(self) -> dict[str, Any]:
        return await self._wait(self.actor.ready.remote())

    async def stats(self) -> dict[str, Any]:
        return await self._wait(self.actor.stats.remote())

    # ---------------------------------------------------------------- writes
    async def next_turn_order(self, user_id: str) -> float:
        return await self._wait(self.actor.next_turn_order.remote(user_id))

    async def check_room(self, user_id: str, facts: Sequence[NewFact] = (), turns: Sequence[Turn] = ()) -> None:
        """QuotaExceeded (memory.records) unless the user has room for all of them."""
        await self._wait(self.actor.check_room.remote(user_id, list(facts), list(turns)))

    async def add_turns(self, user_id: str, turns: Sequence[Turn]) -> None:
        await self._wait(self.actor.add_turns.remote(user_id, list(turns)))

    async def check_encode_backlog(self, user_id: str, new_facts: int) -> None:
        await self._wait(self.actor.check_encode_backlog.remote(user_id, new_facts))

    async def add_facts(self, user_id: str, facts: Sequence[NewFact]) -> list[dict[str, Any]]:
        return await self._wait(self.actor.add_facts.remote(user_id, list(facts)))

    async def update(self, fact_id: str, user_id: str, text: str, metadata: dict[str, Any] | None = None) -> FactRecord:
        return await self._wait(self.actor.update.remote(fact_id, user_id, text, metadata))

    async def delete(self, fact_id: str, user_id: str) -> FactRecord:
        return await self._wait(self.actor.delete.remote(fact_id, user_id))

    async def delete_all(self, user_id: str) -> int:
        return await self._wait(self.actor.delete_all.remote(user_id))

    # ---------------------------------------------------------------- reads
    async def get(self, fact_id: str, user_id: str) -> FactRecord:
        return await self._wait(self.actor.get.remote(fact_id, user_id))

    async def get_all(self, user_id: str) -> list[FactRecord]:
        return await self._wait(self.actor.get_all.remote(user_id))

    async def history(self, fact_id: str, user_id: str) -> list[FactEvent]:
        return await self._wait(self.actor.history.remote(fact_id, user_id))

    async def search(self, user_id: str, query: str, k: int) -> list[MemoryHit]:
        return await self._wait(self.actor.search.remote(user_id, query, k))

    async def plan_chat(self, query: ChatQuery) -> ChatPlan:
        """The shard's plan for a chat: over the plan channel, or through Ray when it does not answer."""
        if self.plan_channel is not None:
            try:
                return await self.plan_channel.plan(query)
            except PlanChannelTimeout as exc:
                self.plans_over_ray += 1
                logger.warning("%s; asking through Ray", exc)
        return await self._wait(self.actor.plan_chat.remote(query))

    # ---------------------------------------------------------------- encoding (memory.shard.EncodeQueue)
    async def take_encode_jobs(self, max_jobs: int | None = None) -> list[EncodeJob]:
        return await self._wait(self.actor.take_encode_jobs.remote(max_jobs))

    async def complete_encode_jobs(self, outcomes: dict[str, EncodeOutcome]) -> int:
        return await self._wait(self.actor.complete_encode_jobs.remote(outcomes))

    async def encode_pending(self, fact_ids: Sequence[str]) -> list[str]:
        return await self._wait(self.actor.encode_pending.remote(list(fact_ids)))

    async def health(self, timeout_s: float | None = None) -> str:
        return await self._wait(self.actor.health.remote(), timeout_s)
