"""ShardWatchdog (serve_app.replica.shard_watchdog) against real Ray actors with the shard actor's
probe group (actors.shard_actor.PROBE_GROUP):
- a shard whose lock one call holds still answers its probes at once, saying which call and for
  how long; once that passes restart_after_s the watchdog kills it with restart allowed, Ray starts
  a new process, and probes answer "ok" again; a shard that answers is never restarted;
- a shard process that answers no probe at all (stuck whole) is restarted after restart_after_s
  of silence, but never one that has not answered since it started (a shard still loading)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from actors.shard_calls import PROBE_GROUP, ShardHealth
from actors.shard_client import ShardClient
from serve_app.replica.shard_watchdog import ShardWatchdog

pytestmark = pytest.mark.slow

OPTIONS = {"max_restarts": -1, "max_task_retries": 0, "num_cpus": 0}
GROUPS = {PROBE_GROUP: 1}  # the shard actor's probe group


class Wedgeable:
    """Probes like a ShardActor (no lock, in the probe group): `wedge` holds the shard's one call
    thread; `freeze` blocks the probe thread too (a process stuck whole)."""

    def __init__(self, load_s: float = 0.0) -> None:
        time.sleep(load_s)  # a shard rebuilding a large memory
        self.busy: tuple[str, float] | None = None
        self.frozen = threading.Event()

    def health(self, call_deadline: float | None = None) -> ShardHealth:
        if self.frozen.is_set():
            time.sleep(3600)
        busy = self.busy
        return ShardHealth("ok", busy[0] if busy else None, time.monotonic() - busy[1] if busy else 0.0)

    def pid(self) -> int:
        return os.getpid()

    def wedge(self) -> None:
        self.busy = ("wedge", time.monotonic())
        time.sleep(3600)

    def freeze(self) -> None:
        self.frozen.set()


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=1, include_dashboard=False)
    yield
    ray.shutdown()


def test_a_shard_wedged_in_one_call_is_restarted_and_a_live_one_is_not(ray_session) -> None:
    import ray

    actor = ray.remote(concurrency_groups=GROUPS)(Wedgeable).options(**OPTIONS).remote()
    watchdog = ShardWatchdog(ShardClient(actor, timeout_s=30), probe_timeout_s=0.5, restart_after_s=3.0)

    async def run() -> None:
        first_pid = await actor.pid.remote()
        for _ in range(4):  # answering: never restarted
            assert await watchdog.probe() == "ok"
        assert watchdog.restarts == 0
        actor.wedge.remote()
        states = []
        while watchdog.restarts == 0:
            states.append(await watchdog.probe())
            assert len(states) < 40, states
            await asyncio.sleep(0.2)
        # every probe was answered at once, the busy call named, until it held the shard too long
        assert any(s.startswith("ok (busy: wedge for") for s in states), states
        assert states[-1].startswith("restarted: wedge has held it for"), states
        deadline = time.monotonic() + 60
        while await watchdog.probe() != "ok":  # Ray starts the actor again
            assert time.monotonic() < deadline, "the restarted actor never answered"
            await asyncio.sleep(0.5)
        assert await actor.pid.remote() != first_pid
        assert watchdog.restarts == 1

    asyncio.run(run())


def test_a_shard_stuck_whole_is_restarted_after_its_silence(ray_session) -> None:
    import ray

    actor = ray.remote(concurrency_groups=GROUPS)(Wedgeable).options(**OPTIONS).remote()
    watchdog = ShardWatchdog(ShardClient(actor, timeout_s=30), probe_timeout_s=0.3, restart_after_s=2.0)

    async def run() -> list[str]:
        await actor.pid.remote()  # started
        assert await watchdog.probe() == "ok"
        await actor.freeze.remote()
        states = []
        while watchdog.restarts == 0:
            states.append(await watchdog.probe())
            assert len(states) < 40, states
        return states

    states = asyncio.run(run())
    assert states[0].startswith("unavailable") and states[-1].startswith("restarted: answered nothing for"), states


def test_a_shard_that_never_answered_is_left_loading(ray_session) -> None:
    import ray

    actor = ray.remote(concurrency_groups=GROUPS)(Wedgeable).options(**OPTIONS).remote(load_s=3600)  # loading from the first call on
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
