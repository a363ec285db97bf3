"""GPU tiers of the fact arena, kept by the engine worker: the pinned host tier and an HBM tier.

Host tier: the arena's kv.bin (shared memory, authoritative). The worker registers it with
CUDA (cudaHostRegister, portable + mapped), so the GPU reads it over PCIe without a bounce
through pageable memory, and views it as a CUDA tensor: the copy kernel reads host rows directly.

HBM tier: a device tensor of `device_pages` arena pages ([num_layers, device_pages *
page_tokens, 2, kv_heads, head_size]), a page -> slot map tagged with the owning entry and
its generation (a freed and reused page never hits a stale copy), promotion on use (pages an
injection reads completely are copied in and kept), LRU demotion when full (the host copy stays
authoritative, so demotion is only forgetting). Residency is published to the arena's
`page_device` table for the owner's accounting.

Injection per step (GpuInjector.inject): tokens whose page is resident are injected from the
HBM tier by one fused kernel over all layers on the compute stream. Other tokens are copied
from the host tier into a staging buffer (and into the HBM tier where promoted) and injected
from there; when the engine runs the attention layers eagerly (piecewise CUDA graphs or
eager mode), that work goes layer group by layer group on a side stream and each attention
layer waits only for its own group (wait_for_layer_load), so PCIe traffic overlaps the forward.
When a FULL CUDA graph will replay (no per-layer hooks run), everything is issued on the
compute stream before the forward. Nothing is ever captured into a graph.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from connector.fact_arena import FactArena

logger = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


# ============================================================================ host pinning
def _device_pointer(host_ptr: int) -> int | None:
    """The device address of registered (mapped) host memory, or None when it cannot be read."""
    path = None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcudart.so" in line:
                    path = line.split()[-1]
                    break
    except OSError:
        pass
    if path is not None:
        try:
            lib = ctypes.CDLL(path)
            out = ctypes.c_void_p()
            if lib.cudaHostGetDevicePointer(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0) == 0 and out.value:
                return int(out.value)
        except (OSError, AttributeError):
            pass
    try:
        from cuda.bindings import runtime as cudart  # cuda-python, where installed

        err, pointer = cudart.cudaHostGetDevicePointer(host_ptr, 0)
        if int(err) == 0:
            return int(pointer)
    except Exception:  # noqa: BLE001 - optional dependency, any failure means "unknown"
        pass
    return None


class _CudaArrayInterface:
    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def pin_host_tensor(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """Register `host` (contiguous CPU tensor) with CUDA and return a CUDA view of the same bytes.

    Returns None (logged) where registration or mapping fails; the caller then copies through
    pageable memory instead.
    """
    if not host.is_contiguous():
        raise ValueError("only a contiguous tensor can be pinned in place")
    nbytes = host.numel() * host.element_size()
    try:
        rc = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED))
    except Exception as exc:  # noqa: BLE001
        logger.warning("cudaHostRegister unavailable (%s); the host tier is copied through pageable memory", exc)
        return None
    if rc not in (0, _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED):
        logger.warning("cudaHostRegister of %d bytes failed with CUDA error %d; pageable copies instead", nbytes, rc)
        return None
    pointer = _device_pointer(host.data_ptr())
    if pointer is None:
        logger.warning("no device address for the pinned host tier; pageable copies instead")
        return None
    with torch.cuda.device(device):
        flat = torch.as_tensor(_CudaArrayInterface(pointer, nbytes), device=device)
    return flat.view(host.dtype).view(host.shape)


# ============================================================================ residency
class DeviceTierMap:
    """Which arena page each HBM-tier slot holds, tagged (entry, generation); LRU eviction."""

    def __init__(self, capacity: int, num_pages: int) -> None:
        self.capacity = capacity
        self.page_slot = np.full(num_pages, -1, dtype=np.int64)
        self.slot_page = np.full(capacity, -1, dtype=np.int64)
        self.slot_tag = np.full((capacity, 2), -1, dtype=np.int64)
        self.last_use = np.zeros(capacity, dtype=np.int64)
        self.clock = 0

    def lookup(self, pages: np.ndarray, entries: np.ndarray, generations: np.ndarray) -> np.ndarray:
        """Slot of each page whose resident copy belongs to this entry generation, else -1; marks use."""
        self.clock += 1
        slots = self.page_slot[pages] if self.capacity else np.full(len(pages), -1, dtype=np.int64)
        found = np.flatnonzero(slots >= 0)
        if len(found):
            candidate = slots[found]
            stale = (self.slot_tag[candidate, 0] != entries[found]) | (self.slot_tag[candidate, 1] != generations[found])
            slots[found[stale]] = -1
            self.last_use[slots[slots >= 0]] = self.clock
        return slots

    def assign(
        self,
        pages: np.ndarray,
        entries: np.ndarray,
        generations: np.ndarray,
        protected: np.ndarray,
        evict: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Give slots to `pages` (unique, not validly resident). Returns (slots or -1, evicted pages).

        A page keeps its own stale slot; otherwise free slots go first, then (if `evict`) the
        least recently used slots outside `protected` (the slots this step reads)."""
        out = np.full(len(pages), -1, dtype=np.int64)
        if self.capacity == 0 or len(pages) == 0:
            return out, np.empty(0, dtype=np.int64)
        own = self.page_slot[pages]
        out[own >= 0] = own[own >= 0]
        need = np.flatnonzero(out < 0)
        taken = np.zeros(self.capacity, dtype=bool)
        taken[protected[protected >= 0]] = True
        taken[out[out >= 0]] = True
        free = np.flatnonzero((self.slot_page < 0) & ~taken)
        n_free = min(len(need), len(free))
        out[need[:n_free]] = free[:n_free]
        taken[free[:n_free]] = True
        rest = need[n_free:]
        if len(rest) and evict:
            candidates = np.flatnonzero(~taken)
            if len(candidates):
                k = min(len(rest), len(candidates))
                order = np.argpartition(self.last_use[candidates], k - 1)[:k] if k < len(candidates) else np.arange(len(candidates))
                victims = candidates[order][:k]
                out[rest[:k]] = victims
        chosen = np.flatnonzero(out >= 0)
        slots = out[chosen]
        previous = self.slot_page[slots]
        evicted = previous[(previous >= 0) & (previous != pages[chosen])]
        self.page_slot[evicted] = -1
        self.slot_page[slots] = pages[chosen]
        self.page_slot[pages[chosen]] = slots
        self.slot_tag[slots, 0] = entries[chosen]
        self.slot_tag[slots, 1] = generations[chosen]
        self.last_use[slots] = self.clock
        return out, evicted

    def drop_pages(self, pages: np.ndarray) -> np.ndarray:
        """Forget these pages where resident; returns those that were."""
        pages = np.asarray(pages, dtype=np.int64)
        resident = pages[self.page_slot[pages] >= 0] if self.capacity else np.empty(0, dtype=np.int64)
        slots = self.page_slot[resident]
        self.slot_page[slots] = -1
        self.slot_tag[slots] = -1
        self.page_slot[resident] = -1
        return resident

    def drop_all(self) -> np.ndarray:
        """Forget every resident page; returns the pages that were resident."""
        pages = self.slot_page[self.slot_page >= 0].copy()
        self.page_slot[pages] = -1
        self.slot_page[:] = -1
        self.slot_tag[:] = -1
        return pages

    def resident_pages(self) -> int:
        return int((self.slot_page >= 0).sum())


def layer_groups(num_layers: int, cap: int = 8) -> list[tuple[int, int]]:
    """[start, end) groups of sizes 1, 1, 2, 4, ... capped: small first so the forward starts early."""
    groups, start, size = [], 0, 1
    while start < num_layers:
        end = min(num_layers, start + size)
        groups.append((start, end))
        if len(groups) > 1:
            size = min(cap, size * 2)
        start = end
    return groups


# ============================================================================ injector
@dataclass
class InjectorStats:
    steps: int = 0
    layerwise_steps: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    promoted_pages: int = 0
    evicted_pages: int = 0
    captured_tokens: int = 0
    unwaited_groups: int = 0
    inject_cpu_s: float = 0.0  # host time spent issuing injection work (start_load_kv)

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class _Pending:
    """Side-stream work of one step: group events, which layers they cover, keep-alive tensors."""

    events: list[torch.cuda.Event]
    group_of_layer: list[int]
    waited: list[bool]
    keep: list[torch.Tensor] = field(default_factory=list)


class GpuInjector:
    """Fused GPU injection and capture over the pinned host tier and the HBM tier."""

    def __init__(self, arena: FactArena, layers: list[torch.Tensor], repositioner, device_pages: int, promote_on_capture: bool = True) -> None:
        from connector import triton_inject

        self.kernels = triton_inject
        self.arena = arena
        g = arena.geometry
        self.page_tokens = g.page_tokens
        self.device = layers[0].device
        self.cache = triton_inject.PagedCacheRef(layers)
        self.num_layers = len(layers)
        self.row_shape = (2, g.num_kv_heads, g.head_size)
        self.dtype = g.torch_dtype
        self.rotary_dim = repositioner.rotary_dim
        self.is_neox_style = repositioner.is_neox_style
        self.max_distance = repositioner.max_distance
        self.cos = repositioner._cos.to(self.device)
        self.sin = repositioner._sin.to(self.device)
        # On a CPU device (tests, under TRITON_INTERPRET=1) the arena itself is the "mapped" view
        # and everything runs in order on the one stream.
        self.on_cuda = self.device.type == "cuda"
        self.host = pin_host_tensor(arena.kv, self.device) if self.on_cuda else arena.kv
        capacity = min(device_pages, g.num_pages)
        self.tier_map = DeviceTierMap(capacity, g.num_pages)
        self.tier = torch.empty((g.num_layers, capacity * g.page_tokens, *self.row_shape), dtype=self.dtype, device=self.device)
        self.staging = torch.empty((g.num_layers, 0, *self.row_shape), dtype=self.dtype, device=self.device)
        self.promote_on_capture = promote_on_capture
        self.groups = layer_groups(self.num_layers)
        self.group_of_layer = [gi for gi, (s, e) in enumerate(self.groups) for _ in range(s, e)]
        self.side_stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None
        self.events = [torch.cuda.Event() for _ in self.groups] if self.on_cuda else []
        self.pending: _Pending | None = None
        self.stats = InjectorStats()
        if self.on_cuda:
            self._warm_up()
        logger.info(
            "GPU injector: HBM tier %d pages (%.2f GiB), host tier %s, %d layer groups",
            capacity,
            self.tier.numel() * self.tier.element_size() / 2**30,
            "pinned and mapped" if self.host is not None else "pageable",
            len(self.groups),
        )

    def _warm_up(self) -> None:
        """Compile every kernel variant now, not in a request: one token into cache slot 0.

        Block 0 is vLLM's null block (never read for a request), so writing it is harmless."""
        row0, slot0, none = self._to_device(np.zeros(1), np.zeros(1), np.full(1, -1))
        staging = self._ensure_staging(1)
        src = self.host if self.host is not None else staging
        self.kernels.copy_rows(src, row0, staging, row0)
        self.kernels.copy_rows(src, row0, staging, row0, self.tier if self.tier.shape[1] else staging, none)
        self._inject(staging, row0, slot0, row0)  # all layers (distance 0)
        self._inject(staging, row0, slot0, row0, 1, 1)  # a layer range
        self.kernels.extract(self.cache, slot0, staging, row0)
        torch.cuda.current_stream(self.device).synchronize()

    # ---------------------------------------------------------------- helpers
    def _owners(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        entries = self.arena.page_owner[pages].astype(np.int64)
        generations = self.arena.entries["generation"][np.maximum(entries, 0)].astype(np.int64)
        generations[entries < 0] = -2  # not owned: never matches a tag
        return entries, generations

    def _fully_read(self, pages: np.ndarray, entries: np.ndarray, rows_read: np.ndarray) -> np.ndarray:
        """Whether each page's rows read this step are all of its valid rows (so a copy is whole).

        Column-wise over the owners' table rows: a per-page loop over the structured table
        cost ~10 us a page, most of a host-tier step's host time."""
        owned = entries >= 0
        rows = self.arena.entries[np.where(owned, entries, 0)]  # copies of the owners' records
        max_pages = rows["pages"].shape[1]
        in_entry = (rows["pages"] == pages[:, None]) & (np.arange(max_pages) < rows["n_pages"][:, None])
        found = in_entry.any(axis=1)
        index = in_entry.argmax(axis=1)  # the page's place in its entry
        valid = np.minimum(self.page_tokens, rows["n_tokens"].astype(np.int64) - index * self.page_tokens)
        return owned & found & (rows_read == valid)

    def _to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """One host->device copy for several int64 arrays; returns device views.

        Each view starts 16-byte aligned: Triton specialises pointer arguments on 16-byte
        alignment, so a view at an odd int64 offset would compile another kernel variant."""
        starts, offset = [], 0
        for a in arrays:
            starts.append(offset)
            offset += len(a) + (len(a) & 1)
        packed = np.zeros(offset, dtype=np.int64)
        for start, a in zip(starts, arrays):
            packed[start : start + len(a)] = a
        device = torch.from_numpy(packed).to(self.device, non_blocking=True)
        return [device[start : start + len(a)] for start, a in zip(starts, arrays)]

    def _ensure_staging(self, rows: int) -> torch.Tensor:
        if self.staging.shape[1] < rows:
            size = max(rows, int(self.staging.shape[1] * 1.5), 256)
            self.staging = torch.empty((self.num_layers, size, *self.row_shape), dtype=self.dtype, device=self.device)
        return self.staging

    def _publish(self, pages: np.ndarray, slots: np.ndarray) -> None:
        self.arena.publish_residency(pages.astype(np.int64), slots.astype(np.int32))

    # ---------------------------------------------------------------- injection
    def inject(self, arena_slots: np.ndarray, cache_slots: np.ndarray, distances: np.ndarray, layerwise: bool) -> None:
        if len(arena_slots) == 0:
            return
        started = time.perf_counter()
        try:
            self._inject_step(arena_slots, cache_slots, distances, layerwise)
        finally:
            self.stats.inject_cpu_s += time.perf_counter() - started

    def _inject_step(self, arena_slots: np.ndarray, cache_slots: np.ndarray, distances: np.ndarray, layerwise: bool) -> None:
        if int(np.abs(distances).max()) > self.max_distance:
            raise ValueError(f"position distance beyond the rotary table ({self.max_distance})")
        self.join()
        pt = self.page_tokens
        pages, inverse = np.unique(arena_slots // pt, return_inverse=True)
        entries, generations = self._owners(pages)
        page_slots = self.tier_map.lookup(pages, entries, generations)
        token_slot = page_slots[inverse]
        hit = token_slot >= 0
        self.stats.steps += 1
        self.stats.tokens += len(arena_slots)
        self.stats.hit_tokens += int(hit.sum())

        miss = ~hit
        n_miss = int(miss.sum())
        # resident tokens: one launch over all layers, on the compute stream
        hit_rows = token_slot[hit] * pt + arena_slots[hit] % pt
        if n_miss == 0:
            rows_d, slots_d, dist_d = self._to_device(hit_rows, cache_slots[hit], distances[hit])
            self._inject(self.tier, rows_d, slots_d, dist_d)
            return

        # the rest: host rows -> staging (+ HBM tier where a whole page is read) -> paged cache
        miss_rows, miss_token_stage = np.unique(arena_slots[miss], return_inverse=True)
        miss_pages, miss_page_of_row = np.unique(miss_rows // pt, return_inverse=True)
        rows_read = np.bincount(miss_page_of_row, minlength=len(miss_pages))
        m_entries, m_generations = self._owners(miss_pages)
        promote = self._fully_read(miss_pages, m_entries, rows_read)
        new_slots = np.full(len(miss_pages), -1, dtype=np.int64)
        if self.tier_map.capacity and promote.any():
            chosen = np.flatnonzero(promote)
            assigned, evicted = self.tier_map.assign(
                miss_pages[chosen], m_entries[chosen], m_generations[chosen], protected=page_slots[page_slots >= 0]
            )
            new_slots[chosen] = assigned
            placed = chosen[assigned >= 0]
            self.stats.promoted_pages += len(placed)
            self.stats.evicted_pages += len(evicted)
            self._publish(np.concatenate((evicted, miss_pages[placed])), np.concatenate((np.full(len(evicted), -1), new_slots[placed])))
        row_slot = new_slots[miss_page_of_row]
        tier_rows = np.where(row_slot >= 0, row_slot * pt + miss_rows % pt, -1)
        self.stats.miss_tokens += n_miss
        staging = self._ensure_staging(len(miss_rows))
        stage_rows = np.arange(len(miss_rows), dtype=np.int64)

        layerwise = layerwise and self.on_cuda and self.host is not None
        if self.host is None:  # pageable fallback: gather on the CPU, one copy to the device
            staging[:, : len(miss_rows)].copy_(self.arena.kv.index_select(1, torch.from_numpy(miss_rows)))
        (
            hit_rows_d, hit_slots_d, hit_dist_d,
            host_rows_d, stage_rows_d, tier_rows_d,
            tok_stage_d, miss_slots_d, miss_dist_d,
        ) = self._to_device(
            hit_rows, cache_slots[hit], distances[hit],
            miss_rows, stage_rows, tier_rows,
            miss_token_stage, cache_slots[miss], distances[miss],
        )  # fmt: skip
        promote_any = bool((tier_rows >= 0).any())
        if len(hit_rows):
            self._inject(self.tier, hit_rows_d, hit_slots_d, hit_dist_d)
        if not layerwise:
            if self.host is not None:
                self.kernels.copy_rows(self.host, host_rows_d, staging, stage_rows_d, self.tier if promote_any else None, tier_rows_d)
            elif promote_any:
                self.kernels.copy_rows(staging, stage_rows_d, self.tier, tier_rows_d)
            self._inject(staging, tok_stage_d, miss_slots_d, miss_dist_d)
            return

        self.stats.layerwise_steps += 1
        compute = torch.cuda.current_stream(self.device)
        side = self.side_stream
        side.wait_stream(compute)  # blocks and buffers of earlier steps are settled
        with torch.cuda.stream(side):
            for gi, (start, end) in enumerate(self.groups):
                n = end - start
                self.kernels.copy_rows(
                    self.host, host_rows_d, staging, stage_rows_d, self.tier if promote_any else None, tier_rows_d, start, n
                )
                self._inject(staging, tok_stage_d, miss_slots_d, miss_dist_d, start, n)
                self.events[gi].record(side)
        keep = [staging, host_rows_d]
        for t in keep:
            t.record_stream(side)
        self.pending = _Pending(self.events, self.group_of_layer, [False] * len(self.groups), keep)

    def _inject(self, src, rows, slots, dist, start: int = 0, n: int | None = None) -> None:
        self.kernels.inject(self.cache, src, rows, slots, dist, self.cos, self.sin, self.rotary_dim, self.is_neox_style, start, n)

    def wait_layer(self, layer_index: int) -> None:
        pending = self.pending
        if pending is None:
            return
        group = pending.group_of_layer[layer_index]
        if not pending.waited[group]:
            torch.cuda.current_stream(self.device).wait_event(pending.events[group])
            pending.waited[group] = True

    def join(self) -> None:
        """Make the compute stream wait for all side-stream work of the step (end of the step)."""
        pending = self.pending
        if pending is None:
            return
        unwaited = [g for g, w in enumerate(pending.waited) if not w]
        if unwaited:
            self.stats.unwaited_groups += len(unwaited)
            logger.warning("layer groups %s were injected but never waited for by an attention layer", unwaited)
            torch.cuda.current_stream(self.device).wait_event(pending.events[unwaited[-1]])
        self.pending = None

    # ---------------------------------------------------------------- capture
    def capture(self, cache_slots: np.ndarray, arena_slots: np.ndarray) -> None:
        """Paged cache -> host tier (authoritative) and, where free slots exist, the HBM tier."""
        if len(cache_slots) == 0:
            return
        self.join()
        self.stats.captured_tokens += len(cache_slots)
        pt = self.page_tokens
        slots_d, rows_d = self._to_device(cache_slots, arena_slots)
        if self.host is not None:
            self.kernels.extract(self.cache, slots_d, self.host, rows_d)
        else:
            buffer = self._ensure_staging(len(arena_slots))
            self.kernels.extract(self.cache, slots_d, buffer, torch.arange(len(arena_slots), device=self.device))
            self.arena.kv[:, torch.from_numpy(arena_slots)] = buffer[:, : len(arena_slots)].cpu()
        if self.tier_map.capacity and self.promote_on_capture:
            pages = np.unique(arena_slots // pt)
            entries, generations = self._owners(pages)
            current = self.tier_map.lookup(pages, entries, generations)
            fresh = np.flatnonzero(current < 0)
            assigned, _ = self.tier_map.assign(pages[fresh], entries[fresh], generations[fresh], protected=current, evict=False)
            page_slots = current.copy()
            page_slots[fresh] = assigned
            self._publish(pages[page_slots >= 0], page_slots[page_slots >= 0])
            token_slot = page_slots[np.searchsorted(pages, arena_slots // pt)]
            keep = token_slot >= 0
            if keep.any():
                slots_k, rows_k = self._to_device(cache_slots[keep], token_slot[keep] * pt + arena_slots[keep] % pt)
                self.kernels.extract(self.cache, slots_k, self.tier, rows_k)
        if self.on_cuda:
            torch.cuda.current_stream(self.device).synchronize()  # the owner commits once generate returns

    def drop_device_tier(self, entry_ids: list[int] | None = None) -> int:
        """Forget HBM-resident pages (all, or those of `entry_ids`): the host tier is authoritative."""
        self.join()
        if entry_ids is None:
            pages = self.tier_map.drop_all()
        else:
            pages = self.tier_map.drop_pages(np.flatnonzero(np.isin(self.arena.page_owner, np.asarray(entry_ids, dtype=np.int32))))
        self._publish(pages, np.full(len(pages), -1))
        return len(pages)
