"""The shard actor's options (actors/shard_actor.SHARD_ACTOR_OPTIONS) survive what wedged the
shard on the H200: requests that make shard calls, cancelled by the hundred while those calls
are in flight (as Serve cancels the requests of disconnected clients, and Ray cancels the calls
they made). With Ray's default in-order execution a later call of the same caller then waits
for good (reproduced here within 3-18 rounds of 25); with the shard's options every round's
health call still answers.

The shard is a light actor with the real options: the ordering is Ray's, not MemoryShard's."""

from __future__ import annotations

import random
import time

import pytest

from actors.shard_actor import SHARD_ACTOR_OPTIONS

pytestmark = pytest.mark.slow


class LightShard:
    def work(self) -> str:
        time.sleep(0.003)
        return "w"

    def ping(self) -> str:
        return "pong"


class Replica:
    """Stands where the LLM replica stands: async requests that await shard calls."""

    def __init__(self, shard) -> None:
        self.shard = shard

    async def request(self) -> str:
        for _ in range(3):  # a chat's plan, a memory read, ...
            await self.shard.work.remote()
        return "done"

    async def health(self) -> str:
        return await self.shard.ping.remote()


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


def test_cancelled_requests_never_wedge_the_shard(ray_session) -> None:
    import ray

    shard = ray.remote(LightShard).options(**SHARD_ACTOR_OPTIONS).remote()
    replica = ray.remote(Replica).options(max_concurrency=1000, num_cpus=0).remote(shard)
    assert ray.get(replica.health.remote(), timeout=30) == "pong"
    rng = random.Random(1)
    for round_index in range(25):
        requests = [replica.request.remote() for _ in range(100)]
        time.sleep(rng.uniform(0.05, 0.4))
        for ref in requests:
            ray.cancel(ref)  # recursive: the shard calls they made are cancelled too
        try:
            assert ray.get(replica.health.remote(), timeout=10) == "pong"
        except ray.exceptions.GetTimeoutError:
            pytest.fail(f"the shard stopped answering after round {round_index}")


class SlowShard:
    """The shard actor's own lock wrapper (actors.shard_actor.shard_call) over two calls the
    replica makes: a long `stats` holds the shard while later `search` calls pile up behind it."""

    def __init__(self) -> None:
        import threading

        from actors.shard_actor import ShardLease

        self.lock, self.busy, self.shed_calls, self.searched = threading.RLock(), None, 0, 0
        self.lease = ShardLease(0.0, lambda: None)

    def stats(self) -> dict:
        time.sleep(5.0)  # longer than the ten searches' 0.3 s timeouts in a row, with room for a loaded machine
        return {}

    def search(self, user_id: str, query: str, k: int) -> list:
        self.searched += 1
        return []

    def searches(self) -> tuple[int, int]:
        return self.searched, self.shed_calls


def test_calls_whose_callers_gave_up_are_never_run(ray_session) -> None:
    """Issue 34: a busy or restarting shard must not work through a backlog nobody waits for. Ten
    searches time out behind a 5 s call; none of them runs afterwards (cancelled in Ray, or shed by
    their deadline at the lock), and the next search runs as usual."""
    import asyncio

    import ray

    from actors.shard_actor import shard_call
    from actors.shard_client import ShardClient, ShardTimeout

    wrapped = type("WrappedSlowShard", (SlowShard,), {n: shard_call(getattr(SlowShard, n)) for n in ("stats", "search", "searches")})
    from actors.shard_actor import SHARD_ACTOR_GROUPS

    options = {k: v for k, v in SHARD_ACTOR_OPTIONS.items() if k != "lifetime"}  # ends with the test's Ray
    shard = ray.remote(concurrency_groups=SHARD_ACTOR_GROUPS)(wrapped).options(**options).remote()
    client = ShardClient(shard, timeout_s=0.3)

    async def run() -> tuple[int, int]:
        assert await shard.searches.remote() == (0, 0)  # the actor is up: the long call starts at once
        busy = asyncio.ensure_future(ShardClient(shard, timeout_s=30).stats())
        await asyncio.sleep(0.3)
        for _ in range(10):
            with pytest.raises(ShardTimeout):
                await client.search("u", "q", 5)
        await busy
        await asyncio.sleep(0.5)
        await ShardClient(shard, timeout_s=30).search("u", "q", 5)
        return await shard.searches.remote()

    searched, shed = asyncio.run(run())
    assert searched == 1, (searched, shed)  # only the last one; the ten were cancelled or shed
