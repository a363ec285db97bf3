"""A model's memory geometry, read from its config.json: KV bytes per token and a weights estimate.

Pure arithmetic over the Hugging Face config (no transformers, torch or vLLM import), so the
application builder can plan a card before anything heavy loads. Dense decoder-only models with
standard attention (Llama, Qwen, Mistral, SmolLM); a mixture of experts counts every expert's MLP.
Quantized weights are not modelled: the estimate is for weights of the engine's dtype.

Tensor parallelism (vLLM's tensor_parallel_size) splits the weights and the KV heads across its
cards; with more cards than KV heads vLLM replicates a head on each card, so a card holds
max(1, kv_heads // tp) of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs of a model (config.json's names in the comments)."""

    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads (default: num_attention_heads)
    head_dim: int  # head_dim (default: hidden_size // num_attention_heads)
    hidden: int  # hidden_size
    intermediate: int  # intermediate_size (per expert for a mixture of experts)
    vocab: int  # vocab_size
    tied: bool  # tie_word_embeddings: the LM head is the embedding matrix
    experts: int = 1  # num_local_experts / num_experts
    name: str = ""

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "") -> "ModelShape":
        """From a config.json's dict (a multimodal config's text_config when it has one)."""
        text = config.get("text_config") or config
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        return cls(
            num_layers=int(text["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            hidden=hidden,
            intermediate=int(text["intermediate_size"]),
            vocab=int(text["vocab_size"]),
            tied=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            experts=int(text.get("num_local_experts") or text.get("num_experts") or 1),
            name=name or str((config.get("architectures") or [config.get("model_type", "model")])[0]),
        )

    def kv_heads_per_card(self, tp: int = 1) -> int:
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token(self, dtype: str, tp: int = 1) -> int:
        """K and V of every layer for one token, on one card of a tensor-parallel group."""
        return 2 * self.num_layers * self.kv_heads_per_card(tp) * self.head_dim * DTYPE_BYTES[dtype]

    def parameters(self) -> int:
        """Parameter count: attention (q, k, v, o), gated MLP (gate, up, down), norms, embeddings."""
        attention = self.hidden * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden * self.intermediate * self.experts
        layer = attention + mlp + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.num_layers * layer + embeddings + self.hidden

    def weight_bytes(self, dtype: str, tp: int = 1) -> int:
        """Weights on one card of a tensor-parallel group (vLLM shards every matrix, the
        vocabulary included, across the group)."""
        return -(-self.parameters() * DTYPE_BYTES[dtype] // tp)


def read_model_config(model: str) -> dict[str, Any]:
    """config.json of a model folder, or of a hub id through Hugging Face's cache (a download
    unless HF_HUB_OFFLINE is set). Raises OSError when it cannot be had."""
    folder = Path(model).expanduser()
    if (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text())
    if folder.is_dir():
        raise OSError(f"{folder} has no config.json")
    from huggingface_hub import hf_hub_download  # no torch; only for a hub id

    return json.loads(Path(hf_hub_download(model, "config.json")).read_text())
