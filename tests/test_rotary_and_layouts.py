"""Rotary re-positioning against vLLM's own rope, and paged-layout round trips through the CPU kernel."""

from __future__ import annotations

import pytest
import torch

from connector.layouts import CpuAttnLayout, FlashAttnLayout, UnsupportedLayout, layout_for_metadata
from connector.rotary import KeyRepositioner

ROPES = [
    ({"rope_type": "default", "rope_theta": 10000.0}, True),
    ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}, True),
    ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}, True),
    ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, False),  # gptj pairs, partial
]


@pytest.mark.parametrize("rope_parameters,neox", ROPES)
def test_rotation_by_distance_equals_rope_at_the_new_position(rope_parameters, neox) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=4096, is_neox_style=neox, rope_parameters=rope_parameters, dtype=torch.float32)
    repositioner = KeyRepositioner.from_rope(rope, 64)
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(40, 2, 64, generator=generator)
    # Positions below ~100: there fp32 rope tables (the reference) are accurate to 1e-6; at
    # position p they carry an angle error of ulp(p * inv_freq), whatever re-positions them.
    encode = torch.arange(40, 80)
    serve = torch.cat((torch.arange(3, 23), torch.arange(70, 90)))  # moved back and forth
    query = torch.zeros(40, 128)
    _, at_encode = rope.forward_native(encode, query.clone(), keys.reshape(40, -1).clone())
    _, at_serve = rope.forward_native(serve, query.clone(), keys.reshape(40, -1).clone())
    moved = repositioner.rotate(at_encode.view(40, 2, 64), serve - encode)
    error = (moved - at_serve.view(40, 2, 64)).abs().max() / at_serve.abs().max()
    assert error <= 1e-5
    assert torch.equal(repositioner.rotate(at_encode.view(40, 2, 64), torch.zeros(40, dtype=torch.long)), at_encode.view(40, 2, 64))


@pytest.mark.parametrize("isa,dtype", [("vec", torch.float32), ("vec", torch.bfloat16), ("vec16", torch.float32)])
def test_cpu_layout_reads_back_what_the_engine_kernel_wrote(isa, dtype) -> None:
    layout = CpuAttnLayout(isa)
    cache = torch.zeros(3, 2, 128, 64, dtype=dtype)
    slots = torch.tensor([0, 5, 127, 128, 300, 301])
    keys, values = torch.randn(6, 2, 32).to(dtype), torch.randn(6, 2, 32).to(dtype)
    layout.write(cache, slots, keys, values)
    got_k, got_v = layout.read(cache, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    untouched = torch.ones(384, dtype=torch.bool)
    untouched[slots] = False
    assert torch.count_nonzero(layout.read(cache, torch.nonzero(untouched).flatten())[0]) == 0


def test_flash_layout_round_trip_and_unknown_backend() -> None:
    layout = FlashAttnLayout()
    cache = torch.zeros(4, 2, 16, 2, 32)
    slots = torch.tensor([1, 17, 63])
    keys, values = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    layout.write(cache, slots, keys, values)
    assert torch.equal(cache[1, 0, 1], keys[1]) and torch.equal(cache[3, 1, 15], values[2])
    with pytest.raises(UnsupportedLayout):
        layout_for_metadata(object(), object())
