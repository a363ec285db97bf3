"""Triton kernels of the GPU injection path: fused gather + rotate + scatter, and row copies.

`inject` reads the stored K/V rows of the injected tokens from a source tensor laid out like
the arena ([num_layers, rows, 2, kv_heads, head_size]: the HBM tier or a staging buffer),
rotates the keys by (serving position - encode position) with the rotation table of
connector.rotary.KeyRepositioner (vLLM's get_rope, neox or gptj pairing, partial rotary
dims), and stores K and V into vLLM's paged cache, logical shape
(num_blocks, 2, block_size, kv_heads, head_size) with any strides (NHD or HND), in one pass:
one launch covers a range of layers. The layers' caches are separate allocations; the kernel
addresses them as element offsets from layer 0's tensor.

`copy_rows` copies whole token rows (2 * kv_heads * head_size elements) between arena-shaped
tensors, for a range of layers, optionally into a second destination as well; it moves host
tier rows (pinned and mapped into the GPU's address space) into the HBM tier or staging.

`extract` is the capture direction: paged-cache slots -> arena-shaped rows, keys unchanged.

The math matches KeyRepositioner.rotate (fp32, then rounded to the cache dtype); tests compare
the two (tests/test_triton_inject.py, under TRITON_INTERPRET=1 on a CPU machine).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Sizes and offsets that change from step to step are not specialised (no recompilation when a
# token count happens to be 1 or a multiple of 16).
@triton.jit(do_not_specialize=["src_layer_stride", "n_tokens", "layer_start", "dst2_layer_stride"])
def _inject_kernel(
    src_ptr,
    src_rows_ptr,
    src_layer_stride,
    cache_ptr,
    layer_offsets_ptr,
    cache_slots_ptr,
    dist_ptr,
    cos_ptr,
    sin_ptr,
    table_stride,
    n_tokens,
    layer_start,
    block_size,
    stride_block,
    stride_kv,
    stride_off,
    stride_head,
    dst2_ptr,
    dst2_rows_ptr,
    dst2_layer_stride,
    H: tl.constexpr,
    D: tl.constexpr,
    HD_P2: tl.constexpr,
    ROT: tl.constexpr,
    NEOX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_DST2: tl.constexpr,
):
    pid_t = tl.program_id(0)
    layer = (layer_start + tl.program_id(1)).to(tl.int64)
    kv = tl.program_id(2)  # 0: keys (rotated), 1: values (copied)

    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < n_tokens
    e = tl.arange(0, HD_P2)  # flat (head, dim) index inside a K or V row
    e_mask = e < H * D
    h = e // D
    d = e % D
    mask = t_mask[:, None] & e_mask[None, :]

    rows = tl.load(src_rows_ptr + t, mask=t_mask, other=0).to(tl.int64)
    row_base = src_ptr + layer * src_layer_stride + rows[:, None] * (2 * H * D) + kv * (H * D)
    x_stored = tl.load(row_base + e[None, :], mask=mask, other=0.0)
    x = x_stored.to(tl.float32)
    if HAS_DST2:  # the row as stored (keys unrotated) into a second arena-shaped tensor where dst2_rows >= 0
        rows2 = tl.load(dst2_rows_ptr + t, mask=t_mask, other=-1).to(tl.int64)
        mask2 = mask & (rows2 >= 0)[:, None]
        dst2 = dst2_ptr + layer * dst2_layer_stride + rows2[:, None] * (2 * H * D) + kv * (H * D) + e[None, :]
        tl.store(dst2, x_stored.to(dst2_ptr.dtype.element_ty), mask=mask2)

    # partner element of each rotated dim and the sign of its sin term
    if NEOX:
        half = ROT // 2
        first = d < half
        partner = tl.where(first, d + half, d - half)
        ci = tl.where(first, d, d - half)
    else:
        first = (d % 2) == 0
        partner = tl.where(first, d + 1, d - 1)
        ci = d // 2
    sgn = tl.where(first, -1.0, 1.0)
    is_key = (e * 0 + kv) == 0  # (no tl.zeros: the interpreter rejects it once vLLM imported triton)
    rot_mask = mask & ((d < ROT) & is_key)[None, :]

    dist = tl.load(dist_ptr + t, mask=t_mask, other=0).to(tl.int64)
    mag = tl.where(dist < 0, -dist, dist)
    dsign = tl.where(dist < 0, -1.0, 1.0)
    table_off = mag[:, None] * table_stride + ci[None, :]
    c = tl.load(cos_ptr + table_off, mask=rot_mask, other=1.0)
    s = tl.load(sin_ptr + table_off, mask=rot_mask, other=0.0) * dsign[:, None]
    # the partner elements from the row already in registers (a second load would cross PCIe
    # again when src is the mapped host tier); padding lanes point at themselves
    partner_e = tl.where(e_mask, h * D + partner, e)
    xp = tl.gather(x, tl.broadcast_to(partner_e[None, :], (BLOCK_T, HD_P2)), 1)
    out = x * c + (sgn[None, :] * xp) * s  # = x where not rotated (c = 1, s = 0)

    slots = tl.load(cache_slots_ptr + t, mask=t_mask, other=0).to(tl.int64)
    blocks = slots // block_size
    offsets = slots % block_size
    layer_off = tl.load(layer_offsets_ptr + layer)
    dst = (
        cache_ptr
        + layer_off
        + blocks[:, None] * stride_block
        + kv * stride_kv
        + offsets[:, None] * stride_off
        + h[None, :] * stride_head
        + d[None, :]
    )
    tl.store(dst, out.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["dst_layer_stride", "n_tokens", "layer_start"])
def _extract_kernel(
    cache_ptr,
    layer_offsets_ptr,
    cache_slots_ptr,
    dst_ptr,
    dst_rows_ptr,
    dst_layer_stride,
    n_tokens,
    layer_start,
    block_size,
    stride_block,
    stride_kv,
    stride_off,
    stride_head,
    H: tl.constexpr,
    D: tl.constexpr,
    HD_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid_t = tl.program_id(0)
    layer = (layer_start + tl.program_id(1)).to(tl.int64)
    kv = tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < n_tokens
    e = tl.arange(0, HD_P2)
    e_mask = e < H * D
    h = e // D
    d = e % D
    mask = t_mask[:, None] & e_mask[None, :]
    slots = tl.load(cache_slots_ptr + t, mask=t_mask, other=0).to(tl.int64)
    layer_off = tl.load(layer_offsets_ptr + layer)
    src = (
        cache_ptr
        + layer_off
        + (slots // block_size)[:, None] * stride_block
        + kv * stride_kv
        + (slots % block_size)[:, None] * stride_off
        + h[None, :] * stride_head
        + d[None, :]
    )
    x = tl.load(src, mask=mask, other=0.0)
    rows = tl.load(dst_rows_ptr + t, mask=t_mask, other=0).to(tl.int64)
    dst = dst_ptr + layer * dst_layer_stride + rows[:, None] * (2 * H * D) + kv * (H * D) + e[None, :]
    tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["src_layer_stride", "dst_layer_stride", "dst2_layer_stride", "n_rows", "layer_start"])
def _copy_rows_kernel(
    src_ptr,
    src_rows_ptr,
    src_layer_stride,
    dst_ptr,
    dst_rows_ptr,
    dst_layer_stride,
    dst2_ptr,
    dst2_rows_ptr,
    dst2_layer_stride,
    n_rows,
    layer_start,
    ROW: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    HAS_DST2: tl.constexpr,
):
    pid_r = tl.program_id(0)
    layer = (layer_start + tl.program_id(1)).to(tl.int64)
    e = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < n_rows
    mask = r_mask[:, None] & (e < ROW)[None, :]
    src_rows = tl.load(src_rows_ptr + r, mask=r_mask, other=0).to(tl.int64)
    x = tl.load(src_ptr + layer * src_layer_stride + src_rows[:, None] * ROW + e[None, :], mask=mask, other=0.0)
    dst_rows = tl.load(dst_rows_ptr + r, mask=r_mask, other=0).to(tl.int64)
    tl.store(dst_ptr + layer * dst_layer_stride + dst_rows[:, None] * ROW + e[None, :], x, mask=mask)
    if HAS_DST2:
        dst2_rows = tl.load(dst2_rows_ptr + r, mask=r_mask, other=-1).to(tl.int64)
        mask2 = mask & (dst2_rows >= 0)[:, None]
        tl.store(dst2_ptr + layer * dst2_layer_stride + dst2_rows[:, None] * ROW + e[None, :], x, mask=mask2)


# ----------------------------------------------------------------------------- launchers
class PagedCacheRef:
    """The layers' paged caches as one base tensor plus per-layer element offsets."""

    def __init__(self, layers: list[torch.Tensor]) -> None:
        first = layers[0]
        if first.dim() != 5 or first.shape[1] != 2:
            raise ValueError(f"expected (num_blocks, 2, block_size, kv_heads, head_size) caches, got {tuple(first.shape)}")
        if first.stride(-1) != 1:
            raise ValueError("the head dimension of the paged cache must be contiguous")
        for layer in layers:
            if layer.shape != first.shape or layer.stride() != first.stride() or layer.dtype != first.dtype:
                raise ValueError("all layers' caches must share shape, strides and dtype")
        element = first.element_size()
        deltas = [layer.data_ptr() - first.data_ptr() for layer in layers]
        if any(delta % element for delta in deltas):
            raise ValueError("layer caches are not element-aligned with each other")
        self.base = first
        self.layer_offsets = torch.tensor([delta // element for delta in deltas], dtype=torch.int64, device=first.device)
        self.num_layers = len(layers)
        self.block_size = first.shape[2]
        self.kv_heads = first.shape[3]
        self.head_size = first.shape[4]
        self.strides = (first.stride(0), first.stride(1), first.stride(2), first.stride(3))


def _hd_p2(heads: int, head_size: int) -> int:
    return triton.next_power_of_2(heads * head_size)


def _block_t(hd_p2: int) -> int:
    return max(1, min(16, 4096 // hd_p2))


def inject(
    cache: PagedCacheRef,
    src: torch.Tensor,
    src_rows: torch.Tensor,
    cache_slots: torch.Tensor,
    distances: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    is_neox_style: bool,
    layer_start: int = 0,
    num_layers: int | None = None,
    dst2: torch.Tensor | None = None,
    dst2_rows: torch.Tensor | None = None,
) -> None:
    """Paged cache slots[t] of layers [layer_start, +num_layers) <- src rows[t], keys rotated by distances[t];
    with dst2, also dst2[l, dst2_rows[t]] <- src[l, rows[t]] as stored where dst2_rows[t] >= 0.

    src (the HBM tier, a staging buffer, or the mapped host tier) and dst2: [num_layers, rows, 2,
    kv_heads, head_size], contiguous; cos/sin: [max_distance + 1, rotary_dim // 2] fp32
    (KeyRepositioner's table) on the cache's device.
    """
    n = int(src_rows.shape[0])
    layers = cache.num_layers - layer_start if num_layers is None else num_layers
    if n == 0 or layers <= 0:
        return
    if not src.is_contiguous():
        raise ValueError("the source rows must be contiguous")
    hd_p2 = _hd_p2(cache.kv_heads, cache.head_size)
    block_t = _block_t(hd_p2)
    grid = (triton.cdiv(n, block_t), layers, 2)
    _inject_kernel[grid](
        src,
        src_rows,
        src.stride(0),
        cache.base,
        cache.layer_offsets,
        cache_slots,
        distances,
        cos,
        sin,
        cos.stride(0),
        n,
        layer_start,
        cache.block_size,
        *cache.strides,
        dst2 if dst2 is not None else src,
        dst2_rows if dst2 is not None else src_rows,
        dst2.stride(0) if dst2 is not None else 0,
        H=cache.kv_heads,
        D=cache.head_size,
        HD_P2=hd_p2,
        ROT=rotary_dim,
        NEOX=is_neox_style,
        BLOCK_T=block_t,
        HAS_DST2=dst2 is not None,
        num_warps=4,
    )


def extract(
    cache: PagedCacheRef,
    cache_slots: torch.Tensor,
    dst: torch.Tensor,
    dst_rows: torch.Tensor,
    layer_start: int = 0,
    num_layers: int | None = None,
) -> None:
    """dst rows[t] of layers [layer_start, +num_layers) <- paged cache slots[t] (K and V as stored)."""
    n = int(cache_slots.shape[0])
    layers = cache.num_layers - layer_start if num_layers is None else num_layers
    if n == 0 or layers <= 0:
        return
    hd_p2 = _hd_p2(cache.kv_heads, cache.head_size)
    block_t = _block_t(hd_p2)
    _extract_kernel[(triton.cdiv(n, block_t), layers, 2)](
        cache.base,
        cache.layer_offsets,
        cache_slots,
        dst,
        dst_rows,
        dst.stride(0),
        n,
        layer_start,
        cache.block_size,
        *cache.strides,
        H=cache.kv_heads,
        D=cache.head_size,
        HD_P2=hd_p2,
        BLOCK_T=block_t,
        num_warps=4,
    )


def copy_rows(
    src: torch.Tensor,
    src_rows: torch.Tensor,
    dst: torch.Tensor,
    dst_rows: torch.Tensor,
    dst2: torch.Tensor | None = None,
    dst2_rows: torch.Tensor | None = None,
    layer_start: int = 0,
    num_layers: int | None = None,
) -> None:
    """dst[l, dst_rows[i]] (and dst2[l, dst2_rows[i]] where >= 0) <- src[l, src_rows[i]] for layers in range.

    All three are [num_layers, rows, 2, kv_heads, head_size] with contiguous rows."""
    n = int(src_rows.shape[0])
    layers = src.shape[0] - layer_start if num_layers is None else num_layers
    if n == 0 or layers <= 0:
        return
    row = src.shape[2] * src.shape[3] * src.shape[4]
    block_e = min(1024, triton.next_power_of_2(row))
    has_dst2 = dst2 is not None
    grid = (triton.cdiv(n, 4), layers, triton.cdiv(row, block_e))
    _copy_rows_kernel[grid](
        src,
        src_rows,
        src.stride(0),
        dst,
        dst_rows,
        dst.stride(0),
        dst2 if has_dst2 else dst,
        dst2_rows if has_dst2 else dst_rows,
        dst2.stride(0) if has_dst2 else 0,
        n,
        layer_start,
        ROW=row,
        BLOCK_R=4,
        BLOCK_E=block_e,
        HAS_DST2=has_dst2,
        num_warps=4,
    )
