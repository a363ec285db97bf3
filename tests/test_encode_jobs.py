"""The shard's encode jobs, without an engine: each batch bounded in prompt tokens, each job
salted with its owner's prefix-cache scope."""

from __future__ import annotations

import shutil
import uuid

import pytest

from memory.records import NewFact
from memory.shard import PREFIX_KEY, MemoryShard
from tests.test_memory_shard import shard_settings

pytestmark = pytest.mark.slow


def test_encodes_are_salted_per_user_like_their_chats(smollm2_dir, redis_server) -> None:
    """Two users with the same fact text: their encode requests carry each user's own cache salt
    (the one the replica gives that user's chats), so one user's encode never fills a prefix-cache
    block the other can hit. The shared instruction prefix is the only unsalted entry."""
    from memory.composition import user_salt
    from memory.kv_lifecycle import PREFIX_KEY

    settings = shard_settings(window_turns=0)
    shard = MemoryShard(0, settings, str(smollm2_dir), "float32", redis_server.url, namespace=uuid.uuid4().hex[:8])
    try:
        ids = {user: shard.add_facts(user, [NewFact(text="Likes green tea.")])[0].fact_id for user in ("lea", "max")}
        jobs = shard.take_encode_jobs()
        salts = {job.key: job.cache_salt for job in jobs}
        assert salts[ids["lea"]] == user_salt(settings.redis_prefix, "lea")
        assert salts[ids["max"]] == user_salt(settings.redis_prefix, "max") != salts[ids["lea"]]
        assert PREFIX_KEY in salts and salts[PREFIX_KEY] is None  # a fresh arena: the shared prefix is queued too
        shard.complete_encode_jobs({job.job_id: None for job in jobs})
    finally:
        shard.arena.close()
        shutil.rmtree(settings.arena_dir, ignore_errors=True)


def test_an_encode_batch_is_bounded_in_prompt_tokens(smollm2_dir, redis_server) -> None:
    """A backlog of queued facts goes to the engine in batches of at most encode_batch_tokens
    prompt tokens (one job always goes, however long), so a batch finishes
    within its timeout on a slow engine."""
    settings = shard_settings(window_turns=0).model_copy(update={"encode_batch_tokens": 100})
    shard = MemoryShard(0, settings, str(smollm2_dir), "float32", redis_server.url, namespace=uuid.uuid4().hex[:8])
    try:
        shard.complete_encode_jobs({job.job_id: None for job in shard.take_encode_jobs()})  # the prefix, if queued
        ids = [r.fact_id for r in shard.add_facts("nia", [NewFact(text=f"Nia's note number {i} is about {i} kites.") for i in range(8)])]
        seen: list[str] = []
        sizes: list[int] = []
        while batch := shard.take_encode_jobs():
            assert len(batch) == 1 or sum(len(job.token_ids) for job in batch) <= 100
            # the prefix not run is queued again as a user of its own (round robin): facts only here
            seen, sizes = seen + [job.key for job in batch if job.key != PREFIX_KEY], sizes + [len(batch)]
            shard.complete_encode_jobs({job.job_id: None for job in batch})  # not run: queued again at the back
            if len(seen) >= len(ids):
                break
        assert sorted(seen[: len(ids)]) == sorted(ids)  # each fact once before any twice
        assert len(sizes) > 1 and max(sizes) < len(ids)  # split by the budget, not by encode_batch (32)
    finally:
        shard.arena.close()
        shutil.rmtree(settings.arena_dir, ignore_errors=True)
