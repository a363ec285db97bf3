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
after the forward, copies captured ranges into the arena.

Anything wrong with a request's memory (malformed parameters, an unknown, stale or freed
entry, tokens that do not match, no cache_salt) makes that request fall back to a plain
prefill of its own prompt tokens: the output is correct, only slower, and the engine goes on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import ValidationError

from connector.fact_arena import EntryView, FactArena
from connector.layouts import PagedKVLayout, layout_for_metadata
from connector.params import PARAMS_KEY, CaptureOp, InjectOp, KVMemoryConnectorMetadata, KVMemoryParams
from connector.rotary import KeyRepositioner
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
            self._scheduler: _SchedulerSide | None = _SchedulerSide(arena, vllm_config.cache_config.block_size)
            self._worker: _WorkerSide | None = None
        else:
            self._scheduler = None
            self._worker = _WorkerSide(arena, KeyRepositioner.from_vllm_config(vllm_config))

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
        return  # injection is synchronous: every layer is in place before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # captures are copied once, after the whole forward (wait_for_save)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVMemoryConnectorMetadata)
        self._worker.capture(metadata)


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
    capture: _Placement | None = None
    offered_from: int = 0  # num_computed_tokens the last offer was made for
    load_range: tuple[int, int] | None = None  # granted by vLLM, consumed by the next metadata
    block_ids: list[int] = field(default_factory=list)
    captured: bool = False


class _SchedulerSide:
    def __init__(self, arena: FactArena, block_size: int) -> None:
        self.arena = arena
        self.block_size = block_size
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
        pinned: list[_Placement] = []
        for placement in params.inject:
            view = self.arena.pin(placement.entry, placement.generation)
            reason = None
            if view is None:
                reason = f"entry {placement.entry} gen {placement.generation} is unknown, stale or freed"
            elif placement.start + view.n_tokens > len(prompt) or not np.array_equal(
                self.arena.entry_token_ids(view), prompt[placement.start : placement.start + view.n_tokens]
            ):
                reason = f"entry {placement.entry} tokens do not match prompt positions {placement.start}.."
            if reason is not None:
                if view is not None:
                    pinned.append(_Placement(view, placement.start))
                for p in pinned:
                    self.arena.unpin(p.view.entry_id, p.view.generation)
                self._fallback(request, reason)
                return []
            pinned.append(_Placement(view, placement.start))
        return sorted(pinned, key=lambda p: p.start)

    def _fallback(self, request: "Request", reason: str) -> None:
        self.fallbacks += 1
        logger.warning("request %s falls back to prefill: %s", request.request_id, reason)

    # -------- vLLM hooks
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        plan = self._plan(request)
        if plan is None or not plan.injects:
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
        if plan.load_range is not None:
            start, end = plan.load_range
            plan.load_range = None
            positions = np.arange(start, end, dtype=np.int64)
            arena_slots = np.empty_like(positions)
            distances = np.empty_like(positions)
            for placement in plan.injects:
                lo, hi = max(start, placement.start), min(end, placement.end)
                if lo >= hi:
                    continue
                within = np.arange(lo - placement.start, hi - placement.start)
                arena_slots[lo - start : hi - start] = placement.view.token_slots[within]
                distances[lo - start : hi - start] = placement.start - placement.view.encode_start
            metadata.injects.append(InjectOp(req_id, arena_slots, self._cache_slots(plan, positions), distances))
        capture = plan.capture
        if capture is not None and not plan.captured:
            done = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if done >= capture.end:  # the captured range is in the cache after this step
                plan.captured = True
                positions = np.arange(capture.start, capture.end, dtype=np.int64)
                metadata.captures.append(CaptureOp(req_id, self._cache_slots(plan, positions), capture.view.token_slots))

    def _cache_slots(self, plan: _RequestPlan, positions: np.ndarray) -> np.ndarray:
        blocks = np.asarray(plan.block_ids, dtype=np.int64)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    def request_finished(self, request: "Request") -> dict[str, Any] | None:
        """Unpin the request's entries; returns the {"kvmem": {...}} outcome report."""
        plan = self.plans.pop(request.request_id, None)
        if plan is None:
            return None
        for placement in plan.injects:
            self.arena.unpin(placement.view.entry_id, placement.view.generation)
        return {PARAMS_KEY: {"captured": plan.captured}}


# ===================================================================== worker side
class _WorkerSide:
    def __init__(self, arena: FactArena, repositioner: KeyRepositioner) -> None:
        self.arena = arena
        self.repositioner = repositioner
        self.layers: list[torch.Tensor] = []
        self.layer_names: list[str] = []
        self.layout: PagedKVLayout | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        self.layer_names = [name for name, _ in ordered]
        self.layers = [tensor for _, tensor in ordered]
        g = self.arena.geometry
        if len(self.layers) != g.num_layers:
            raise ValueError(f"arena holds {g.num_layers} layers, the model has {len(self.layers)}")
        if self.layers[0].dtype != g.torch_dtype:
            raise ValueError(f"arena dtype {g.dtype} differs from the KV cache dtype {self.layers[0].dtype}")

    def _layout(self, forward_context: "ForwardContext") -> PagedKVLayout | None:
        attn_metadata = getattr(forward_context, "attn_metadata", None)
        if isinstance(attn_metadata, list):
            attn_metadata = attn_metadata[0] if attn_metadata else None
        if isinstance(attn_metadata, dict):
            attn_metadata = attn_metadata.get(self.layer_names[0])
        if attn_metadata is not None and self.layout is None:
            attn_layer = forward_context.no_compile_layers[self.layer_names[0]]
            self.layout = layout_for_metadata(attn_metadata, attn_layer)
        return self.layout

    def start_load_kv(self, forward_context: "ForwardContext", metadata: KVMemoryConnectorMetadata) -> None:
        layout = self._layout(forward_context)
        if not metadata.injects:
            return
        assert layout is not None, "injection scheduled in a step without attention metadata"
        device = self.layers[0].device
        arena_slots = torch.from_numpy(np.concatenate([op.arena_slots for op in metadata.injects]))
        cache_slots = torch.from_numpy(np.concatenate([op.cache_slots for op in metadata.injects])).to(device)
        distances = torch.from_numpy(np.concatenate([op.distances for op in metadata.injects]))
        for layer_index, cache in enumerate(self.layers):
            kv = self.arena.kv[layer_index].index_select(0, arena_slots).to(device)  # [T, 2, H, D]
            keys = self.repositioner.rotate(kv[:, 0], distances)
            layout.write(cache, cache_slots, keys, kv[:, 1])

    def capture(self, metadata: KVMemoryConnectorMetadata) -> None:
        if not metadata.captures:
            return
        assert self.layout is not None, "capture scheduled before any forward"
        cache_slots = torch.from_numpy(np.concatenate([op.cache_slots for op in metadata.captures])).to(self.layers[0].device)
        arena_slots = torch.from_numpy(np.concatenate([op.arena_slots for op in metadata.captures]))
        for layer_index, cache in enumerate(self.layers):
            keys, values = self.layout.read(cache, cache_slots)
            self.arena.kv[layer_index, arena_slots, 0] = keys.to("cpu", self.arena.kv.dtype)
            self.arena.kv[layer_index, arena_slots, 1] = values.to("cpu", self.arena.kv.dtype)
