"""GPU injection and capture of the fact arena, kept by the engine worker (GpuInjector).

GpuInjector works over two tiers of the arena's pages: the host tier (kv.bin, authoritative),
pinned in place and mapped into the device (connector.host_pinning), and an HBM tier of
`device_pages` pages bookkept by connector.device_tier.DeviceTierMap (tagged by entry
generation, promotion on use: pages an injection reads completely are copied in and kept, LRU
demotion when full). Residency is published to the arena's `page_device` table for the
owner's accounting. Erasure: each step first zeroes and forgets the HBM copies of pages whose
entry the arena freed meanwhile (erase_freed_pages), as the arena zeroes the host tier.

Injection per step (GpuInjector.inject): tokens whose page is resident are injected from the
HBM tier by one fused kernel over all layers on the compute stream. Other tokens are read by
the same kernel straight from the pinned, mapped host tier over PCIe; it also stores the rows
of pages promoted by this read into the HBM tier. When the engine runs the attention layers
eagerly (piecewise CUDA graphs or eager mode), that kernel goes layer group by layer group on a
side stream and each attention layer waits only for its own group (wait_for_layer_load), so
PCIe traffic overlaps the forward. (Where pinning failed, host rows are gathered on the CPU into
a staging buffer and injected from there.)
When a FULL CUDA graph will replay (no per-layer hooks run), everything is issued on the
compute stream before the forward. Nothing is ever captured into a graph.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from connector.device_tier import DeviceTierMap, layer_groups
from connector.host_pinning import pin_host_tensor
from kvarena.arena import FactArena

logger = logging.getLogger(__name__)


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
    erased_pages: int = 0  # HBM-tier copies of freed entries' pages zeroed (erase_freed_pages)
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

    def __init__(
        self,
        arena: FactArena,
        layers: list[torch.Tensor],
        repositioner,
        device_pages: int,
        promote_on_capture: bool = True,
        engine_slot: int = 0,
    ) -> None:
        from connector import triton_inject  # Triton: not on the torch path

        self.kernels = triton_inject
        self.arena = arena
        self.engine_slot = engine_slot  # the arena's residency table of this engine
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
        if self.host is None:  # the pageable fallback's staging -> HBM tier copy (nothing is resident yet)
            self.kernels.copy_rows(staging, row0, self.tier if self.tier.shape[1] else staging, row0)
        tier = self.tier if self.tier.shape[1] else staging
        self._inject(staging, row0, slot0, row0)  # all layers (distance 0)
        self._inject(staging, row0, slot0, row0, 1, 1)  # a layer range
        self._inject(src, row0, slot0, row0, dst2=tier, dst2_rows=none)  # from the host tier, promoting (to no row)
        self._inject(src, row0, slot0, row0, 1, 1, tier, none)
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
        was most of a host-tier step's host time."""
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
        alignment, so a view at an odd int64 offset would compile another kernel variant.

        On a GPU the arrays are packed into pinned memory from torch's caching host allocator:
        a copy from pageable memory makes the host wait for the stream to drain first (CUDA's
        pageable cudaMemcpyAsync semantics), and the caching allocator keeps a pinned block from
        reuse until the copy that reads it has finished, so no buffer bookkeeping is needed here."""
        starts, offset = [], 0
        for a in arrays:
            starts.append(offset)
            offset += len(a) + (len(a) & 1)
        host = torch.empty(offset, dtype=torch.int64, pin_memory=self.on_cuda)
        packed = host.numpy()
        for start, a in zip(starts, arrays):
            packed[start : start + len(a)] = a  # (the odd arrays' padding is never read)
        device = host.to(self.device, non_blocking=True) if self.on_cuda else host
        return [device[start : start + len(a)] for start, a in zip(starts, arrays)]

    def _ensure_staging(self, rows: int) -> torch.Tensor:
        if self.staging.shape[1] < rows:
            size = max(rows, int(self.staging.shape[1] * 1.5), 256)
            self.staging = torch.empty((self.num_layers, size, *self.row_shape), dtype=self.dtype, device=self.device)
        return self.staging

    def _publish(self, pages: np.ndarray, slots: np.ndarray) -> None:
        self.arena.publish_residency(pages.astype(np.int64), slots.astype(np.int32), self.engine_slot)

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
        self.erase_freed_pages()
        pt = self.page_tokens
        # pages as runs of consecutive tokens (an entry's tokens fill its pages in order), not
        # np.unique: a sort of every token costs more than the whole lookup; a page met in two
        # runs is looked up twice, which is harmless
        page_of_token = arena_slots // pt
        run_starts = np.flatnonzero(np.concatenate(([True], page_of_token[1:] != page_of_token[:-1])))
        pages = page_of_token[run_starts]
        entries, generations = self._owners(pages)
        page_slots = self.tier_map.lookup(pages, entries, generations)
        token_slot = np.repeat(page_slots, np.diff(np.append(run_starts, len(page_of_token))))
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
        promote_any = bool((tier_rows >= 0).any())

        if self.host is None:  # pageable fallback: gather on the CPU, one copy to the device, inject from there
            staging = self._ensure_staging(len(miss_rows))
            staging[:, : len(miss_rows)].copy_(self.arena.kv.index_select(1, torch.from_numpy(miss_rows)))
            (
                hit_rows_d, hit_slots_d, hit_dist_d,
                stage_rows_d, tier_rows_d, tok_stage_d, miss_slots_d, miss_dist_d,
            ) = self._to_device(
                hit_rows, cache_slots[hit], distances[hit],
                np.arange(len(miss_rows)), tier_rows, miss_token_stage, cache_slots[miss], distances[miss],
            )  # fmt: skip
            if len(hit_rows):
                self._inject(self.tier, hit_rows_d, hit_slots_d, hit_dist_d)
            if promote_any:
                self.kernels.copy_rows(staging, stage_rows_d, self.tier, tier_rows_d)
            self._inject(staging, tok_stage_d, miss_slots_d, miss_dist_d)
            return

        # pinned and mapped host tier: one kernel per layer range reads each token's row over
        # PCIe, injects it, and stores it into the HBM tier where its page is promoted
        (
            hit_rows_d, hit_slots_d, hit_dist_d,
            host_rows_d, miss_slots_d, miss_dist_d, tier_rows_d,
        ) = self._to_device(
            hit_rows, cache_slots[hit], distances[hit],
            arena_slots[miss], cache_slots[miss], distances[miss], tier_rows[miss_token_stage],
        )  # fmt: skip
        tier = self.tier if promote_any else None
        if len(hit_rows):
            self._inject(self.tier, hit_rows_d, hit_slots_d, hit_dist_d)
        if not (layerwise and self.on_cuda):
            self._inject(self.host, host_rows_d, miss_slots_d, miss_dist_d, dst2=tier, dst2_rows=tier_rows_d)
            return

        self.stats.layerwise_steps += 1
        compute = torch.cuda.current_stream(self.device)
        side = self.side_stream
        side.wait_stream(compute)  # blocks and buffers of earlier steps are settled
        with torch.cuda.stream(side):
            for gi, (start, end) in enumerate(self.groups):
                self._inject(self.host, host_rows_d, miss_slots_d, miss_dist_d, start, end - start, tier, tier_rows_d)
                self.events[gi].record(side)
        host_rows_d.record_stream(side)  # every index array is a view of this one device buffer
        self.pending = _Pending(self.events, self.group_of_layer, [False] * len(self.groups), [host_rows_d])

    def _inject(self, src, rows, slots, dist, start: int = 0, n: int | None = None, dst2=None, dst2_rows=None) -> None:
        self.kernels.inject(
            self.cache, src, rows, slots, dist, self.cos, self.sin, self.rotary_dim, self.is_neox_style, start, n, dst2, dst2_rows
        )

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
        self.erase_freed_pages()
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

    def erase_freed_pages(self) -> int:
        """Zero the HBM copies of pages whose entry the arena freed since they were copied in
        (a deleted or replaced fact's KV must not linger in device memory) and forget them.
        Called at the start of each injection and capture step; a freed entry is zeroed in the
        host tier by the arena itself. Returns how many slots were zeroed."""
        stale = self.tier_map.stale_slots(self._owners)
        if not len(stale):
            return 0
        self.tier_map.drop_pages(self.tier_map.slot_page[stale].copy())
        rows = (stale[:, None] * self.page_tokens + np.arange(self.page_tokens)).reshape(-1)
        self.tier.index_fill_(1, torch.from_numpy(rows).to(self.device), 0)
        self.stats.erased_pages += len(stale)
        return len(stale)

    def drop_device_tier(self, entry_ids: list[int] | None = None) -> int:
        """Forget HBM-resident pages (all, or those of `entry_ids`): the host tier is authoritative."""
        self.join()
        if entry_ids is None:
            pages = self.tier_map.drop_all()
        else:
            pages = self.tier_map.drop_pages(np.flatnonzero(np.isin(self.arena.page_owner, np.asarray(entry_ids, dtype=np.int32))))
        self._publish(pages, np.full(len(pages), -1))
        return len(pages)
