"""Arena geometry: the shape of one model's fact KV arena, and the arena's errors.

Layer 1 of the arena (kvarena.arena's docstring names all three): ArenaGeometry (layers, KV
heads, head size, dtype, page size, capacities), stored as header.json; arena_geometry_for
reads it off a Hugging Face model config. No vLLM; torch only for `torch_dtype`, imported there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class ArenaError(RuntimeError):
    """Misuse of the arena (geometry mismatch, unknown entry, stale generation)."""


class ArenaFull(ArenaError):
    """No free entry or not enough free pages for an allocation."""


@dataclass(frozen=True)
class ArenaGeometry:
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    page_tokens: int = 64
    num_pages: int = 1024
    max_entries: int = 4096
    max_pages_per_entry: int = 64

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch  # not in the builder or ingress

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    @property
    def num_token_slots(self) -> int:
        return self.num_pages * self.page_tokens

    @property
    def max_entry_tokens(self) -> int:
        return self.max_pages_per_entry * self.page_tokens

    def kv_bytes(self) -> int:
        element = _DTYPE_BYTES[self.dtype]
        return self.num_layers * self.num_token_slots * 2 * self.num_kv_heads * self.head_size * element

    @classmethod
    def for_model(cls, hf_config, dtype: str, **capacity) -> "ArenaGeometry":
        """Geometry for a Hugging Face config (text models with standard attention)."""
        text = getattr(hf_config, "text_config", None) or hf_config
        head_size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return cls(num_layers=text.num_hidden_layers, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype, **capacity)


def arena_geometry_for(model_dir: Path | str, dtype: str, **capacity: Any) -> ArenaGeometry:
    """ArenaGeometry matching the model's layers, KV heads and head size in `dtype`."""
    from transformers import AutoConfig  # not in the builder or ingress

    return ArenaGeometry.for_model(AutoConfig.from_pretrained(model_dir), dtype, **capacity)
