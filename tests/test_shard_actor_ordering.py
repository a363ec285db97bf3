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
