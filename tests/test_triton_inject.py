"""The Triton injection kernels and the GPU injector against the torch reference path.

On a machine with a CUDA GPU these run the compiled kernels; elsewhere they run under Triton's
interpreter (TRITON_INTERPRET=1, set for these tests only). The interpreter rounds fp32 to
bf16 by truncation, not to nearest as the GPU does, so bf16 results are compared to one ulp
there and must match exactly on a GPU in all but a few elements (fma contraction).
"""

from __future__ import annotations

import importlib
import zlib
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from kvarena.arena import ArenaGeometry, FactArena
from connector.layouts import FlashAttnLayout
from connector.rotary import KeyRepositioner

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

ROPES = {
    "llama3": ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}, True),
    "neox_partial": ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, True),
    "gptj": ({"rope_type": "default", "rope_theta": 10000.0}, False),
    "gptj_partial": ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}, False),
}


@pytest.fixture()
def ti(monkeypatch):
    """connector.triton_inject, compiled on a GPU, interpreted on a CPU machine."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = sys.modules.get("connector.triton_inject")
    module = importlib.reload(module) if module is not None else importlib.import_module("connector.triton_inject")
    yield module
    if not CUDA:  # leave no interpreted kernels behind for other users of the module
        monkeypatch.delenv("TRITON_INTERPRET")
        importlib.reload(module)


def _repositioner(name: str, head_size: int) -> KeyRepositioner:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params, neox = ROPES[name]
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(head_size, max_position=1024, is_neox_style=neox, rope_parameters=dict(params), dtype=torch.float32)
    return KeyRepositioner.from_rope(rope, head_size)


def _caches(layers: int, blocks: int, block_size: int, heads: int, head_size: int, dtype, hnd: bool) -> list[torch.Tensor]:
    out = []
    for _ in range(layers):
        if hnd:  # physical (blocks, 2, heads, block_size, dim), logical (blocks, 2, block_size, heads, dim)
            cache = torch.full((blocks, 2, heads, block_size, head_size), float("nan"), dtype=dtype, device=DEVICE).permute(0, 1, 3, 2, 4)
        else:
            cache = torch.full((blocks, 2, block_size, heads, head_size), float("nan"), dtype=dtype, device=DEVICE)
        out.append(cache)
    return out


def _reference(caches, src, rows, slots, distances, repositioner) -> list[torch.Tensor]:
    """The torch path: gather, KeyRepositioner.rotate, FlashAttnLayout.write, per layer."""
    ref = [c.clone() for c in caches]
    for layer, cache in enumerate(ref):
        kv = src[layer, rows.cpu()].to(DEVICE)
        FlashAttnLayout().write(cache, slots, repositioner.rotate(kv[:, 0], distances.to(DEVICE)), kv[:, 1])
    return ref


def _compare(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    written = ~torch.isnan(want)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "kernel wrote other slots than the reference"
    g, w = got[written].float(), want[written].float()
    if dtype == torch.float32:
        assert (g - w).abs().max() <= 1e-6 * max(1.0, w.abs().max().item())
    else:  # bf16: one ulp (interpreter truncates); on a GPU nearly all equal
        assert ((g - w).abs() <= w.abs() * 2**-7 + 1e-30).all()
        if CUDA:
            assert (g == w).float().mean() >= 0.999


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("dtype,hnd", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_fused_inject_equals_torch_path(ti, rope, dtype, hnd) -> None:
    heads, head_size, layers, blocks, block_size, tokens, rows = 3, 64, 3, 8, 16, 37, 50
    repositioner = _repositioner(rope, head_size)
    g = torch.Generator().manual_seed(zlib.crc32(f"{rope}/{dtype}/{hnd}".encode()))  # str hash() differs per process
    src = torch.randn(layers, rows, 2, heads, head_size, generator=g).to(dtype)
    row_idx = torch.randperm(rows, generator=g)[:tokens]
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    distances = torch.randint(-900, 900, (tokens,), generator=g)
    distances[:3] = 0  # no rotation: exact copies
    caches = _caches(layers, blocks, block_size, heads, head_size, dtype, hnd)
    want = _reference(caches, src, row_idx, slots.to(DEVICE), distances, repositioner)
    cache_ref = ti.PagedCacheRef(caches)
    ti.inject(
        cache_ref, src.to(DEVICE), row_idx.to(DEVICE), slots.to(DEVICE), distances.to(DEVICE),
        repositioner._cos.to(DEVICE), repositioner._sin.to(DEVICE), repositioner.rotary_dim, repositioner.is_neox_style,
    )  # fmt: skip
    for got, ref in zip(caches, want):
        _compare(got, ref, dtype)
    # zero distance is a bit-exact copy of the stored key
    k, _ = FlashAttnLayout().read(caches[1], slots[:3].to(DEVICE))
    assert torch.equal(k.cpu(), src[1, row_idx[:3], 0])


def test_layer_range_extract_and_row_copy(ti) -> None:
    heads, head_size, layers = 2, 32, 4
    caches = _caches(layers, 4, 16, heads, head_size, torch.float32, False)
    for cache in caches:
        cache.normal_()
    slots = torch.tensor([3, 17, 40, 63], device=DEVICE)
    cache_ref = ti.PagedCacheRef(caches)
    dst = torch.zeros(layers, 10, 2, heads, head_size, device=DEVICE)
    rows = torch.tensor([9, 0, 4, 2], device=DEVICE)
    ti.extract(cache_ref, slots, dst, rows, layer_start=1, num_layers=2)
    for layer in range(layers):
        k, v = FlashAttnLayout().read(caches[layer], slots)
        if layer in (1, 2):
            assert torch.equal(dst[layer, rows, 0], k) and torch.equal(dst[layer, rows, 1], v)
        else:
            assert not dst[layer].any()
    # inject's second destination: the rows as stored (keys unrotated), only where a row is given, only in range
    repositioner = _repositioner("llama3", head_size)
    tier = torch.zeros_like(dst)
    ti.inject(
        cache_ref, dst, rows, slots, torch.tensor([5, 0, 9, 2], device=DEVICE), repositioner._cos.to(DEVICE),
        repositioner._sin.to(DEVICE), repositioner.rotary_dim, repositioner.is_neox_style, 1, 2, tier, torch.tensor([7, -1, 3, 0], device=DEVICE),
    )  # fmt: skip
    for layer in range(layers):
        if layer in (1, 2):
            assert torch.equal(tier[layer, [7, 3, 0]], dst[layer, rows[[0, 2, 3]]]) and not tier[layer, [1, 2, 4, 5, 6, 8, 9]].any()
        else:
            assert not tier[layer].any()
    out, out2 = torch.zeros_like(dst), torch.zeros_like(dst)
    ti.copy_rows(dst, rows, out, torch.tensor([0, 1, 2, 3], device=DEVICE), out2, torch.tensor([5, -1, 6, -1], device=DEVICE))
    assert torch.equal(out[:, :4], dst[:, rows])
    assert torch.equal(out2[:, [5, 6]], dst[:, rows[[0, 2]]]) and not out2[:, [0, 1, 2, 3, 4, 7, 8, 9]].any()


@pytest.fixture()
def shm_path():
    """A folder in /dev/shm where there is one: cudaHostRegister pins shared memory, not disk files."""
    path = Path(tempfile.mkdtemp(prefix="kvmem-test-", dir="/dev/shm" if Path("/dev/shm").exists() else None))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _arena(tmp_path, dtype: str, head_size: int, heads: int, layers: int) -> FactArena:
    geometry = ArenaGeometry(num_layers=layers, num_kv_heads=heads, head_size=head_size, dtype=dtype, page_tokens=8, num_pages=64, max_entries=32, max_pages_per_entry=8)
    arena = FactArena.create(tmp_path / "arena", geometry)
    arena.kv.copy_(torch.randn(arena.kv.shape, generator=torch.Generator().manual_seed(5)).to(arena.kv.dtype))
    return arena


def test_gpu_injector_tiers_match_the_torch_path(ti, shm_path) -> None:
    """Misses (host tier, staged, promoted), hits (HBM tier), LRU eviction, stale pages, capture."""
    from connector.gpu_injector import GpuInjector

    heads, head_size, layers = 2, 64, 3
    arena = _arena(shm_path, "float32", head_size, heads, layers)
    repositioner = _repositioner("llama3", head_size)
    caches = _caches(layers, 16, 16, heads, head_size, torch.float32, False)
    for cache in caches:
        cache.zero_()
    injector = GpuInjector(arena, caches, repositioner, device_pages=6)
    assert injector.host is not None, "the host tier could not be pinned and mapped"
    rng = np.random.default_rng(0)
    refs = [arena.allocate(rng.integers(0, 100, n).tolist(), encode_start=int(rng.integers(0, 50))) for n in (12, 5, 20, 8, 17)]
    for ref in refs:
        arena.commit(ref)
    views = {ref.entry_id: arena.pin(ref.entry_id, ref.generation) for ref in refs}

    def step(entry_ids: list[int], partial_first: int = 0) -> None:
        arena_slots, positions = [], []
        position = 30
        for i, e in enumerate(entry_ids):
            view = views[e]
            cut = partial_first if i == 0 else 0
            arena_slots.append(view.token_slots[cut:])
            positions.append(np.arange(position + cut, position + view.n_tokens))
            position += view.n_tokens
        a = np.concatenate(arena_slots)
        pos = np.concatenate(positions)
        dist = pos - np.concatenate([np.full(views[e].n_tokens - (partial_first if i == 0 else 0), views[e].encode_start) for i, e in enumerate(entry_ids)])
        cache_slots = rng.permutation(16 * 16)[: len(a)]
        want = _reference(caches, arena.kv, torch.from_numpy(a), torch.from_numpy(cache_slots).to(DEVICE), torch.from_numpy(dist), repositioner)
        injector.inject(a, cache_slots, dist, layerwise=True)
        for layer in range(layers):
            injector.wait_layer(layer)
        injector.join()
        for got, ref in zip(caches, want):
            _compare(got, ref, torch.float32)

    e = [ref.entry_id for ref in refs]
    step([e[0], e[1]])  # all misses; both entries' pages read whole: promoted (2 + 1 pages)
    assert injector.stats.miss_tokens == 17 and injector.stats.promoted_pages == 3
    assert arena.usage()["device_pages_resident"] == 3
    step([e[1], e[0]])  # all hits now
    assert injector.stats.hit_tokens == 17 and injector.stats.miss_tokens == 17
    step([e[2], e[3]], partial_first=4)  # entry 2 read from token 4: its first page is not whole
    assert injector.stats.promoted_pages == 3 + 2 + 1  # 2 of entry 2's 3 pages, 1 of entry 3
    assert injector.stats.evicted_pages == 0
    step([e[4]])  # 3 more pages into a full tier: LRU evicts 3 (entries 0/1 are older than 2/3)
    assert injector.stats.evicted_pages == 3 and arena.usage()["device_pages_resident"] == 6
    step([e[0], e[4]])  # entry 0 evicted or not, the results still match
    # a freed and reused page never serves its stale HBM copy
    arena.unpin(refs[4].entry_id, refs[4].generation)
    arena.release(refs[4])
    reused = arena.allocate(list(range(17)), encode_start=3)
    arena.commit(reused)
    arena.kv[:, torch.from_numpy(arena.pin(reused.entry_id, reused.generation).token_slots)] += 1.0
    views[reused.entry_id] = arena.pin(reused.entry_id, reused.generation)
    hits_before = injector.stats.hit_tokens
    step([reused.entry_id])
    assert injector.stats.hit_tokens == hits_before  # same pages as entry 4, new generation: misses

    # one entry placed twice in a step, read from the host tier: both placements right, its page promoted once
    assert injector.drop_device_tier() > 0 and arena.usage()["device_pages_resident"] == 0
    promoted = injector.stats.promoted_pages
    step([e[1], e[1]])
    assert injector.stats.promoted_pages == promoted + 1
    hits_before = injector.stats.hit_tokens
    step([e[1]])
    assert injector.stats.hit_tokens == hits_before + 5

    # capture: paged cache -> host arena and (free slots only) the HBM tier
    assert injector.drop_device_tier() > 0 and arena.usage()["device_pages_resident"] == 0
    target = arena.allocate(list(range(11)), encode_start=0)
    view = arena.writing_view(target.entry_id, target.generation)
    cache_slots = np.arange(40, 51)
    injector.capture(cache_slots, view.token_slots)
    for layer in range(layers):
        k, v = FlashAttnLayout().read(caches[layer], torch.from_numpy(cache_slots).to(DEVICE))
        assert torch.equal(arena.kv[layer, torch.from_numpy(view.token_slots), 0], k.cpu())
        assert torch.equal(arena.kv[layer, torch.from_numpy(view.token_slots), 1], v.cpu())
    assert arena.usage()["device_pages_resident"] == 2  # its 2 pages went to the empty tier
    arena.commit(target)
    views[target.entry_id] = arena.pin(target.entry_id, target.generation)
    hits_before = injector.stats.hit_tokens
    step([target.entry_id])
    assert injector.stats.hit_tokens == hits_before + 11
    arena.close()


def test_gpu_injector_host_tier_only(ti, shm_path) -> None:
    """device_pages=0: every injection is staged from the host tier; bf16 cache."""
    from connector.gpu_injector import GpuInjector

    heads, head_size, layers = 3, 64, 2
    arena = _arena(shm_path, "bfloat16", head_size, heads, layers)
    repositioner = _repositioner("gptj_partial", head_size)
    caches = _caches(layers, 8, 16, heads, head_size, torch.bfloat16, True)
    injector = GpuInjector(arena, caches, repositioner, device_pages=0)
    ref = arena.allocate(list(range(23)), encode_start=7)
    arena.commit(ref)
    view = arena.pin(ref.entry_id, ref.generation)
    cache_slots = np.arange(5, 28)
    dist = np.full(23, 90 - 7)
    want = _reference(caches, arena.kv, torch.from_numpy(view.token_slots), torch.from_numpy(cache_slots).to(DEVICE), torch.from_numpy(dist), repositioner)
    injector.inject(view.token_slots, cache_slots, dist, layerwise=False)
    for got, exp in zip(caches, want):
        _compare(got, exp, torch.bfloat16)
    assert injector.stats.miss_tokens == 23 and injector.stats.promoted_pages == 0
    assert arena.usage()["device_pages_resident"] == 0
    arena.close()


def test_gpu_injector_zeroes_the_hbm_copy_of_a_freed_entry(ti, shm_path) -> None:
    """Erasure in the device tier: an entry freed in the arena (a deleted fact) leaves no bytes in
    the HBM tier after the worker's next step, and its pages are no longer resident; a kept
    entry's copy stays and is still hit."""
    from connector.gpu_injector import GpuInjector

    heads, head_size, layers = 2, 64, 3
    arena = _arena(shm_path, "float32", head_size, heads, layers)
    caches = _caches(layers, 16, 16, heads, head_size, torch.float32, False)
    injector = GpuInjector(arena, caches, _repositioner("llama3", head_size), device_pages=6)
    kept, deleted = arena.allocate(list(range(10)), 0), arena.allocate(list(range(100, 120)), 0)
    for ref, value in ((kept, 3.0), (deleted, 7.0)):
        arena.kv[:, torch.from_numpy(arena.writing_view(ref.entry_id, ref.generation).token_slots)] = value
        arena.commit(ref)

    def inject(ref) -> None:
        view = arena.pin(ref.entry_id, ref.generation)
        injector.inject(view.token_slots, np.arange(view.n_tokens), np.zeros(view.n_tokens, dtype=np.int64), layerwise=False)
        injector.join()
        arena.unpin(ref.entry_id, ref.generation)

    inject(kept)
    inject(deleted)
    assert injector.stats.promoted_pages == 2 + 3 and bool((injector.tier == 7.0).any())  # both copied into HBM
    arena.release(deleted)
    hits = injector.stats.hit_tokens
    inject(kept)  # the next step
    assert not bool((injector.tier == 7.0).any()) and injector.stats.erased_pages == 3
    assert injector.tier_map.resident_pages() == 2 and injector.stats.hit_tokens == hits + 10
    assert bool((injector.tier == 3.0).any())
    arena.close()
