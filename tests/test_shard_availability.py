"""The router's view of which shards are up (serve_app.ingress.shard_availability), from Serve's
own status objects: a shard whose deployment has no RUNNING replica is refused at once with 503
and Retry-After; a slow but running replica, an unknown deployment or an unreachable controller
never is; a call already waiting on a shard is given up once the shard is seen down
(serve_app.ingress.routes.answer_unless). The kill itself, through the real service: tests/test_faults.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger
from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

from serve_app.ingress.shard_availability import ShardAvailability

HANDLES = [SimpleNamespace(app_name="kvmem", deployment_name=f"LLMReplica_{i}") for i in range(2)]


def status(**replica_states: dict[str, int]) -> ServeStatus:
    deployments = {
        name: DeploymentStatusOverview(DeploymentStatus.HEALTHY, DeploymentStatusTrigger.UNSPECIFIED, states, "")
        for name, states in replica_states.items()
    }
    return ServeStatus(applications={"kvmem": ApplicationStatusOverview(ApplicationStatus.RUNNING, "", 0.0, deployments)})


def test_a_shard_without_a_running_replica_is_refused_at_once_until_one_runs() -> None:
    shards = ShardAvailability(HANDLES)
    shards.update(status(LLMReplica_0={"RUNNING": 1}, LLMReplica_1={"RUNNING": 1}))
    assert shards.refusal(0) is None and shards.refusal(1) is None
    shards.update(status(LLMReplica_0={"RUNNING": 1}, LLMReplica_1={"STARTING": 1}))  # replica 1 was killed
    refused = shards.refusal(1)
    assert refused is not None and refused.status_code == 503 and refused.headers == {"Retry-After": "5"}
    assert "restarting" in refused.detail and shards.refusal(0) is None  # the other shard is untouched
    shards.update(status(LLMReplica_0={"RUNNING": 1}, LLMReplica_1={"RUNNING": 1, "STOPPING": 1}))
    assert shards.refusal(1) is None


def test_no_opinion_is_never_a_refusal() -> None:
    shards = ShardAvailability(HANDLES)
    shards.update(status(LLMReplica_0={"RUNNING": 1}))  # LLMReplica_1 not deployed yet
    shards.update(ServeStatus())  # Serve not started: no applications
    assert shards.refusal(0) is None and shards.refusal(1) is None
    shards.update(status(LLMReplica_0={}, LLMReplica_1={"RUNNING": 1}))  # no replica at all: down
    assert shards.refusal(0) is not None


def test_a_call_waiting_on_a_shard_that_goes_down_is_given_up_within_a_second() -> None:
    import asyncio
    import time

    import pytest
    from fastapi import HTTPException

    from serve_app.ingress.replica_calls import answer_unless

    async def never() -> None:
        await asyncio.sleep(3600)

    async def soon() -> str:
        await asyncio.sleep(0.1)
        return "answer"

    async def scenario() -> None:
        assert await answer_unless(soon(), lambda: None, 10) == "answer"
        down_at = time.monotonic() + 1.5  # the shard's replica is seen down 1.5 s into the wait
        refusal = lambda: HTTPException(503, "down") if time.monotonic() >= down_at else None  # noqa: E731
        started = time.monotonic()
        with pytest.raises(HTTPException):
            await answer_unless(never(), refusal, 60)
        assert time.monotonic() - started < 1.5 + 1.2
        with pytest.raises(asyncio.TimeoutError):
            await answer_unless(never(), lambda: None, 0.3)

    asyncio.run(scenario())


def test_a_chat_whose_replica_died_is_asked_again_and_only_then() -> None:
    """replica_calls.with_failover: a 503 caused by a gone replica or engine is tried again (on
    another replica of the shard, as Serve's router picks), at most FAILOVER_ATTEMPTS times; any
    other refusal stands at once, and nothing is retried without other replicas to go to."""
    import asyncio

    from fastapi import HTTPException

    from serve_app.ingress import replica_calls
    from serve_app.protocol import EngineUnavailable

    replica_calls.FAILOVER_PAUSE_S = 0.0

    class ActorDiedError(Exception):
        pass

    def gone() -> HTTPException:
        error = HTTPException(503, "the service is unavailable right now (ActorDiedError)")
        error.__cause__ = ActorDiedError("replica died")
        return error

    def calls(outcomes: list) -> tuple[list, object]:
        made: list = []

        async def attempt(avoid: str | None) -> str:
            made.append(avoid)
            outcome = outcomes[len(made) - 1]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        return made, attempt

    made, attempt = calls([gone(), "answer"])
    assert asyncio.run(replica_calls.with_failover(attempt, enabled=True)) == "answer" and made == [None, None]
    down = HTTPException(503, "the engine is restarting")  # a replica that names itself: avoided next time
    down.__cause__ = EngineUnavailable("the engine of this replica is down", "replica-a")
    made, attempt = calls([down, "answer"])
    assert asyncio.run(replica_calls.with_failover(attempt, enabled=True)) == "answer" and made == [None, "replica-a"]
    made, attempt = calls([gone(), gone(), gone(), "never"])
    with pytest.raises(HTTPException):
        asyncio.run(replica_calls.with_failover(attempt, enabled=True))
    assert len(made) == replica_calls.FAILOVER_ATTEMPTS
    made, attempt = calls([HTTPException(503, "the memory shard is busy"), "never"])
    with pytest.raises(HTTPException):
        asyncio.run(replica_calls.with_failover(attempt, enabled=True))
    assert len(made) == 1  # the shard, not the replica: another replica would wait on the same shard
    made, attempt = calls([gone(), "never"])
    with pytest.raises(HTTPException):
        asyncio.run(replica_calls.with_failover(attempt, enabled=False))
    assert len(made) == 1


def test_the_running_replicas_are_counted_over_the_shards_once_each_was_polled() -> None:
    """/health's llm_replicas.running: below `wanted` while Serve replaces a replica of a shard that
    has others (the shard itself is not refused: another replica serves it)."""
    shards = ShardAvailability(HANDLES)
    shards.update(status(LLMReplica_0={"RUNNING": 2}))
    assert shards.running_total() is None  # LLMReplica_1 not polled yet: not known
    shards.update(status(LLMReplica_0={"RUNNING": 1, "STARTING": 1}, LLMReplica_1={"RUNNING": 2}))
    assert shards.running_total() == 3 and shards.refusal(0) is None
