"""How the ingress waits on a replica: bounded in time, given up as soon as its shard has no
replica running (answer_unless), and, for a chat, failed over to another replica of its shard
(with_failover, llm_replicas_per_shard > 1).

A chat changes nothing, so one whose replica died under it (Ray's ActorDiedError and kin), or whose
replica's engine died (vLLM's EngineDeadError), before any of its answer was sent, is asked again:
Serve's router picks a replica of the same shard, and the dead one is out of its set within a
second or two (the replica's health check fails at once when its engine died, see
serve_app.replica.lifecycle.EngineKeeper). Bounded: FAILOVER_ATTEMPTS tries, FAILOVER_PAUSE_S
apart; past them the last 503 stands. By name, as serve_app.ingress.errors does: the ingress
imports neither Ray's internals nor vLLM.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, TypeVar

from fastapi import HTTPException

logger = logging.getLogger(__name__)

T = TypeVar("T")

FAILOVER_ATTEMPTS = 3
FAILOVER_PAUSE_S = 0.5  # Serve's router learns of a dead replica within about a second
_GONE = {"ActorDiedError", "ActorUnavailableError", "RayActorError", "EngineDeadError", "EngineGenerateError", "EngineUnavailable"}


async def answer_unless(call: Awaitable[Any], refusal: Callable[[], HTTPException | None], timeout_s: float) -> Any:
    """`call`'s answer within `timeout_s` (asyncio.TimeoutError past it), given up with `refusal()`'s
    error as soon as it has one (checked every second: a shard whose replica died meanwhile)."""
    task, deadline = asyncio.ensure_future(call), asyncio.get_running_loop().time() + timeout_s
    while True:
        done, _ = await asyncio.wait({task}, timeout=min(1.0, max(0.0, deadline - asyncio.get_running_loop().time())))
        if done:
            return task.result()
        error = refusal() if asyncio.get_running_loop().time() < deadline else asyncio.TimeoutError()
        if error is not None:
            task.cancel()
            getattr(call, "cancel", lambda: None)()  # a Serve response: cancel the request in the replica too
            raise error


def replica_gone(error: HTTPException) -> tuple[bool, str | None]:
    """(whether a 503 says the replica or its engine is gone, rather than the shard or Redis; the
    replica to avoid when it named itself: EngineUnavailable's replica_id)."""
    cause = error.__cause__
    cause = getattr(cause, "cause", None) or cause
    gone = error.status_code == 503 and type(cause).__name__ in _GONE
    return gone, (getattr(cause, "replica_id", None) or None) if gone else None


async def with_failover(attempt: Callable[[str | None], Awaitable[T]], enabled: bool) -> T:
    """`attempt(avoid)`, tried again on another replica while its replica is gone (module
    docstring); `avoid` is the replica that said its engine is down (None at first)."""
    avoid: str | None = None
    for tried in range(1, FAILOVER_ATTEMPTS + 1):
        try:
            return await attempt(avoid)
        except HTTPException as error:
            gone, named = replica_gone(error)
            avoid = named or avoid
            if not enabled or tried == FAILOVER_ATTEMPTS or not gone:
                raise
            logger.warning("chat's replica gone (%s); asking another replica of the shard", error.detail)
            await asyncio.sleep(FAILOVER_PAUSE_S)
    raise AssertionError("unreachable")
