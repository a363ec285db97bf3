"""Re-positioning of stored keys with the model's own rotary embedding.

A key stored as the engine wrote it at position p is R_p k (vLLM caches rotated keys). Rotary
embeddings are linear in the position angle, so R_v k = R_(v-p) R_p k: re-positioning is one
rotation by the difference d = v - p. The angles come from vLLM's own RotaryEmbedding for the
model's rope parameters (get_rope: llama3 and YaRN scaling, neox or gptj pairing, partial
rotary dims), recomputed in fp32; the rotation is applied with vLLM's ApplyRotaryEmb. Scalings
that multiply cos/sin by an attention factor (YaRN's mscale) are normalised out, since the
stored key already carries the factor once.
"""

from __future__ import annotations

from typing import Any

import torch


class KeyRepositioner:
    """Rotates stored keys by position differences, in place of a fresh prefill at the new position."""

    def __init__(self, head_size: int, rotary_dim: int, is_neox_style: bool, cos_sin_fp32: torch.Tensor) -> None:
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        cos, sin = cos_sin_fp32.double().chunk(2, dim=-1)
        norm = torch.sqrt(cos * cos + sin * sin)  # 1 for plain rotations; YaRN's mscale otherwise
        self._cos = (cos / norm).float().contiguous()
        self._sin = (sin / norm).float().contiguous()

    @property
    def max_distance(self) -> int:
        return self._cos.shape[0] - 1

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "KeyRepositioner":
        """Build from the engine's model config, with the same get_rope call a decoder makes."""
        from vllm.model_executor.layers.rotary_embedding import get_rope  # vLLM: engine core only, not tests

        model_config = vllm_config.model_config
        hf_config = model_config.hf_text_config
        head_size = model_config.get_head_size()
        rope_parameters = dict(getattr(hf_config, "rope_parameters", None) or {})
        partial = getattr(hf_config, "partial_rotary_factor", None)
        if partial is not None and "partial_rotary_factor" not in rope_parameters:
            rope_parameters["partial_rotary_factor"] = partial
        is_neox_style = bool(getattr(hf_config, "rope_is_neox_style", True))
        max_position = rope_max_position(vllm_config)
        from vllm.config import set_current_vllm_config  # vLLM: engine core only, not tests

        with set_current_vllm_config(vllm_config):  # get_rope builds a CustomOp
            rope = get_rope(
                head_size,
                max_position=max_position,
                is_neox_style=is_neox_style,
                rope_parameters=rope_parameters or None,
                dtype=torch.float32,
            )
        return cls.from_rope(rope, head_size)

    @classmethod
    def from_rope(cls, rope: Any, head_size: int) -> "KeyRepositioner":
        """Build from a vLLM RotaryEmbedding instance.

        The rope's own fp32 table is recomputed. Where that table is t * inv_freq (plain,
        llama3 and YaRN frequencies; YaRN's mscale is normalised out) the distance table is
        rebuilt in float64 from the same inv_freq: fp32 angles at large distances carry an
        error of ulp(d * inv_freq), which would dominate the re-positioning error.
        """
        cos_sin = rope._compute_cos_sin_cache().float().cpu()
        try:
            inv_freq = rope._compute_inv_freq(rope.base).double().cpu()
        except Exception:  # rope types without a plain inverse-frequency vector
            inv_freq = None
        if inv_freq is not None and inv_freq.numel() * 2 == cos_sin.shape[-1]:
            angles = torch.arange(cos_sin.shape[0], dtype=torch.float64)[:, None] * inv_freq[None, :]
            precise = torch.cat((angles.cos(), angles.sin()), dim=-1)
            cos, sin = cos_sin.chunk(2, dim=-1)
            norm = torch.sqrt(cos * cos + sin * sin).double()
            probe = slice(0, min(64, cos_sin.shape[0]))  # small angles: fp32 table is accurate there
            if torch.allclose(precise[probe] * torch.cat((norm, norm), dim=-1)[probe], cos_sin[probe].double(), atol=1e-5):
                cos_sin = precise
        return cls(head_size, rope.rotary_dim, rope.is_neox_style, cos_sin)

    def cos_sin(self, distances: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [n, rotary_dim/2] of the rotation by each (possibly negative) distance."""
        magnitude = distances.abs()
        if int(magnitude.max()) > self.max_distance:
            raise ValueError(f"position distance beyond the rotary table ({self.max_distance})")
        cos = self._cos.index_select(0, magnitude.cpu()).to(device)
        sin = self._sin.index_select(0, magnitude.cpu()).to(device)
        sign = torch.where(distances < 0, -1.0, 1.0).to(device=device, dtype=sin.dtype)[:, None]
        return cos, sin * sign

    def rotate(self, keys: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
        """keys [T, kv_heads, head_size] rotated by distances [T] (computed in fp32)."""
        from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb  # vLLM: engine core only, not tests

        if not bool((distances != 0).any()):
            return keys
        cos, sin = self.cos_sin(distances, keys.device)
        rotated = ApplyRotaryEmb.forward_static(
            keys[..., : self.rotary_dim].float(), cos, sin, self.is_neox_style
        ).to(keys.dtype)
        if self.rotary_dim == self.head_size:
            return rotated
        return torch.cat((rotated, keys[..., self.rotary_dim :]), dim=-1)


def rope_max_position(vllm_config: Any) -> int:
    """Positions the repositioner's table is built for: a distance of at most this minus one can
    be applied (the table of a scaled rope may be longer; this bound is the safe one)."""
    model_config = vllm_config.model_config
    return int(getattr(model_config.hf_text_config, "max_position_embeddings", model_config.max_model_len))
