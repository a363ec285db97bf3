"""Read repair (memory.read_repair): a write whose Redis call failed after Redis applied it.

A real redis-server and a MemoryShard (no engine: the shard's bookkeeping). The lost reply is made
the way it happens: the store's real call runs against Redis, then the server is SIGKILLed before
the shard hears back, and the shard sees the ConnectionError a dead server gives. Redis
(appendfsync always) comes back with the write applied; the shard must then take its word.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import redis

from devtools.local_redis import LocalRedis
from memory.records import NewFact
from memory.shard import MemoryShard
from tests.test_memory_shard import shard_settings
from memory.chat_query import ChatQuery

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Which pets do I have?"}]


@pytest.fixture()
def server(tmp_path: Path):
    with LocalRedis(tmp_path / "redis") as local:
        yield local


@pytest.fixture()
def shard(server: LocalRedis, smollm2_dir: Path):
    settings = shard_settings(window_turns=0)
    shard = MemoryShard(0, settings, str(smollm2_dir), "float32", server.url, namespace=uuid.uuid4().hex[:8])
    yield shard
    shard.arena.close()
    shutil.rmtree(settings.arena_dir, ignore_errors=True)


def losing_the_reply(server: LocalRedis, call: Callable[..., Any]) -> Callable[..., Any]:
    """`call`, applied by Redis, whose answer never reaches the caller: the server dies first."""

    def applied_then_lost(*args: Any, **kwargs: Any) -> Any:
        call(*args, **kwargs)
        server.kill()
        raise redis.exceptions.ConnectionError("Connection closed by server.")

    return applied_then_lost


def planned_texts(shard: MemoryShard, user: str) -> set[str]:
    return {hit.text for hit in shard.plan_chat(ChatQuery(user_id=user, messages=QUESTION, top_k=10, mode="prompt")).facts}


def test_an_add_redis_applied_but_never_answered_is_adopted_once_redis_is_back(shard: MemoryShard, server: LocalRedis) -> None:
    user = f"u-{uuid.uuid4().hex[:6]}"
    shard.add_facts(user, [NewFact(text="I have a cat called Miso.")])
    real_add = shard.store.add
    shard.store.add = losing_the_reply(server, real_add)
    with pytest.raises(redis.exceptions.ConnectionError):
        shard.add_facts(user, [NewFact(text="I have a dog called Biscuit.")])
    shard.store.add = real_add
    assert shard.read_repair.unsure == {user}
    # Redis away: chats are served from what the shard has, and the user stays unsure
    assert planned_texts(shard, user) == {"I have a cat called Miso."}
    assert shard.take_encode_jobs() is not None and shard.read_repair.unsure == {user}
    assert shard.read_repair.poll_after > time.monotonic()  # the poll waits RETRY_S before it tries again ...
    assert shard.stats()["users_unsure"] == 1

    server.start()  # back with the applied add (appendfsync always)
    listed = {fact.text: fact for fact in shard.get_all(user)}  # ... a call of the user's does not wait
    assert set(listed) == {"I have a cat called Miso.", "I have a dog called Biscuit."}
    assert listed["I have a dog called Biscuit."].kv == "queued"  # tracked now: its KV follows
    assert shard.read_repair.unsure == set()
    assert planned_texts(shard, user) == set(listed)
    assert [hit.text for hit in shard.search(user, "What is my dog called?", 1)] == ["I have a dog called Biscuit."]


def test_a_lost_delete_is_never_retrieved_and_a_lost_update_serves_the_new_text(shard: MemoryShard, server: LocalRedis) -> None:
    user = f"u-{uuid.uuid4().hex[:6]}"
    results = shard.add_facts(user, [NewFact(text="I live in Lyon."), NewFact(text="I play the cello.")])
    lyon, cello = (r.fact_id for r in results)
    real_delete = shard.store.delete
    shard.store.delete = losing_the_reply(server, real_delete)
    with pytest.raises(redis.exceptions.ConnectionError):
        shard.delete(cello, user)
    shard.store.delete = real_delete
    server.start()
    # the encode driver's poll repairs the user without any call of theirs
    shard.take_encode_jobs()
    assert shard.read_repair.unsure == set()
    assert planned_texts(shard, user) == {"I live in Lyon."} and cello not in shard.facts

    real_update = shard.store.update
    shard.store.update = losing_the_reply(server, real_update)
    with pytest.raises(redis.exceptions.ConnectionError):
        shard.update(lyon, user, "I live in Marseille.")
    shard.store.update = real_update
    server.start()
    assert planned_texts(shard, user) == {"I live in Lyon."}  # the chat path never waits for Redis ...
    shard.take_encode_jobs()  # ... the encode driver's poll (every 0.5 s) repairs the user
    assert planned_texts(shard, user) == {"I live in Marseille."}
    assert shard.facts[lyon].text == "I live in Marseille." and shard.get(lyon, user).kv == "encoding"
    assert (shard.stats()["users_resynced_total"], shard.stats()["users_unsure"]) == (2, 0)
