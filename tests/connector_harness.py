"""Helpers for connector tests: an arena beside an engine, capture and injection requests."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from memory.composition import ComposedPrompt, StoredSegment, compose
from kvarena.arena import arena_geometry_for
from connector.engine_config import kv_transfer_config
from kvarena.arena import EntryRef, FactArena
from kvarena.params import EntryPlacement, KVMemoryParams


def make_arena(model_dir: Path, dtype: str = "float32", **capacity) -> FactArena:
    path = Path(tempfile.mkdtemp(prefix="kvmem-test-", dir="/dev/shm" if Path("/dev/shm").exists() else None))
    return FactArena.create(path, arena_geometry_for(model_dir, dtype, **capacity))


def drop_arena(arena: FactArena) -> None:
    arena.close()
    shutil.rmtree(arena.path, ignore_errors=True)


def sampling(max_tokens: int = 1, params: KVMemoryParams | None = None, logprobs: int | None = None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params.to_kv_transfer_params()} if params is not None else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs, extra_args=extra)


def tokens_prompt(ids: Sequence[int], salt: str | None = None):
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(ids))
    if salt is not None:
        prompt["cache_salt"] = salt
    return prompt


@dataclass
class CaptureJob:
    """Capture the KV of prompt[start:start+n] into a fresh entry."""

    prompt: list[int]
    start: int
    length: int


def capture_batch(llm, arena: FactArena, jobs: Sequence[CaptureJob], salt: str = "kvmem-capture") -> list[StoredSegment]:
    """Run all captures in one engine batch; returns the committed segments."""
    refs: list[EntryRef] = []
    prompts, params = [], []
    for job in jobs:
        tokens = job.prompt[job.start : job.start + job.length]
        ref = arena.allocate(tokens, encode_start=job.start)
        refs.append(ref)
        prompts.append(tokens_prompt(job.prompt, salt))
        placement = EntryPlacement(entry=ref.entry_id, generation=ref.generation, start=job.start)
        params.append(sampling(1, KVMemoryParams(capture=placement)))
    llm.generate(prompts, params, use_tqdm=False)
    segments = []
    for job, ref in zip(jobs, refs):
        arena.commit(ref)
        segments.append(StoredSegment(ref, tuple(job.prompt[job.start : job.start + job.length])))
    return segments


def entry_kv(arena: FactArena, ref: EntryRef) -> torch.Tensor:
    view = arena.pin(ref.entry_id, ref.generation)
    assert view is not None, f"entry {ref} is not live"
    try:
        return arena.entry_kv(view)
    finally:
        arena.unpin(ref.entry_id, ref.generation)


def generate_pair(llm, composed: ComposedPrompt, max_tokens: int = 32, logprobs: int = 20):
    """(prompt injection output, KV injection output) for the same prompt tokens."""
    (plain,) = llm.generate([tokens_prompt(composed.prompt_token_ids)], sampling(max_tokens, logprobs=logprobs), use_tqdm=False)
    (injected,) = llm.generate(
        [tokens_prompt(composed.prompt_token_ids, composed.cache_salt)],
        sampling(max_tokens, composed.params, logprobs=logprobs),
        use_tqdm=False,
    )
    return plain, injected


def first_token_logprob_gap(a, b) -> float:
    """Largest |logprob difference| over the tokens both first-step top-k lists hold."""
    la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
    common = set(la) & set(lb)
    assert len(common) >= min(len(la), len(lb)) // 2, "top-k lists barely overlap"
    return max(abs(la[t].logprob - lb[t].logprob) for t in common)


def random_tokens(rng: np.random.Generator, n: int, vocab: int, low: int = 10) -> list[int]:
    return rng.integers(low, vocab, n).tolist()


__all__ = [
    "CaptureJob",
    "capture_batch",
    "compose",
    "drop_arena",
    "entry_kv",
    "first_token_logprob_gap",
    "generate_pair",
    "kv_transfer_config",
    "make_arena",
    "random_tokens",
    "sampling",
    "tokens_prompt",
]
