"""ShardWatchdog (serve_app.replica.shard_watchdog) against a real Ray actor that stops answering:
probes report "unavailable" while the silence is shorter than restart_after_s, then the watchdog
kills the actor with restart allowed, Ray starts a new process, and probes answer "ok" again;
an actor that answers is never restarted, nor one that has not answered since it started (a
shard still loading)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from actors.shard_client import ShardClient
from serve_app.replica.shard_watchdog import ShardWatchdog

pytestmark = pytest.mark.slow


class Wedgeable:
    """Answers health like a MemoryShard until `wedge` blocks its only thread."""

    def health(self) -> str:
        return "ok"

    def pid(self) -> int:
        return os.getpid()

    def wedge(self) -> None:
        time.sleep(3600)


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=1, include_dashboard=False)
    yield
    ray.shutdown()


def test_a_silent_shard_is_restarted_and_a_live_one_is_not(ray_session) -> None:
    import ray

    actor = ray.remote(Wedgeable).options(max_restarts=-1, max_task_retries=0, num_cpus=0).remote()
    client = ShardClient(actor, timeout_s=30)
    watchdog = ShardWatchdog(client, probe_timeout_s=0.5, restart_after_s=3.0)

    async def run() -> None:
        first_pid = await actor.pid.remote()
        for _ in range(4):  # answering: never restarted
            assert await watchdog.probe() == "ok"
        assert watchdog.restarts == 0
        actor.wedge.remote()
        states = []
        while watchdog.restarts == 0:
            states.append(await watchdog.probe())
            assert len(states) < 20, states
        assert states[0].startswith("unavailable") and states[-1].startswith("restarted")
        assert watchdog.silent_s < 1.0
        deadline = time.monotonic() + 60
        while await watchdog.probe() != "ok":  # Ray starts the actor again
            assert time.monotonic() < deadline, "the restarted actor never answered"
            await asyncio.sleep(0.5)
        assert await actor.pid.remote() != first_pid
        assert watchdog.restarts == 1

    asyncio.run(run())


def test_a_shard_that_never_answered_is_left_loading(ray_session) -> None:
    import ray

    actor = ray.remote(Wedgeable).options(max_restarts=-1, max_task_retries=0, num_cpus=0).remote()
    actor.wedge.remote()  # busy from the first call on, as a shard rebuilding a large memory
    watchdog = ShardWatchdog(ShardClient(actor, timeout_s=30), probe_timeout_s=0.3, restart_after_s=1.0)

    async def run() -> list[str]:
        states = []
        started = time.monotonic()
        while time.monotonic() - started < 3.0:  # three times restart_after_s
            states.append(await watchdog.probe())
        return states

    states = asyncio.run(run())
    assert states and all(s.startswith("unavailable") for s in states), states
    assert watchdog.restarts == 0 and not watchdog.answered
    ray.kill(actor)
