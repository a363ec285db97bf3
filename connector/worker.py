"""Worker half of the KV memory connector (model worker process).

KVMemoryWorker: before the forward, gathers the scheduled entries' KV from the arena, re-rotates
the keys for their serving positions and scatters K and V into vLLM's paged cache; after the
forward, copies captured ranges into the arena. On a GPU with FlashAttention-layout caches and
Triton that is connector.gpu_injector.GpuInjector (HBM tier, fused kernels, layer-by-layer
overlap); elsewhere, and with kv_connector_extra_config {"injector": "torch"}, the torch path
here, which is also the reference the Triton kernels are tested against.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.model_executor.models.utils import extract_layer_index

from connector.gpu_injector import GpuInjector
from connector.layouts import FlashAttnLayout, PagedKVLayout, layout_for_metadata
from connector.metadata import KVMemoryConnectorMetadata
from connector.rotary import KeyRepositioner
from kvarena.arena import FactArena

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

logger = logging.getLogger(__name__)


class KVMemoryWorker:
    """The worker half of KVMemoryConnector (model worker): injects before, captures after the forward."""

    def __init__(
        self,
        arena: FactArena,
        repositioner: KeyRepositioner,
        vllm_config: "VllmConfig | None" = None,
        device_pages: int = 0,
        injector: str = "auto",
        promote_on_capture: bool = True,
        engine_slot: int = 0,
    ) -> None:
        self.arena = arena
        self.engine_slot = engine_slot  # where this engine publishes its HBM tier's residency
        self.repositioner = repositioner
        self.vllm_config = vllm_config
        self.device_pages = device_pages
        self.injector_choice = injector
        self.promote_on_capture = promote_on_capture
        self.layers: list[torch.Tensor] = []
        self.layer_names: list[str] = []
        self.layer_index: dict[str, int] = {}
        self.layout: PagedKVLayout | None = None
        self.gpu: Any = None  # connector.gpu_injector.GpuInjector on a GPU

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        self.layer_names = [name for name, _ in ordered]
        self.layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self.layers = [tensor for _, tensor in ordered]
        g = self.arena.geometry
        if len(self.layers) != g.num_layers:
            raise ValueError(f"arena holds {g.num_layers} layers, the model has {len(self.layers)}")
        if self.layers[0].dtype != g.torch_dtype:
            raise ValueError(f"arena dtype {g.dtype} differs from the KV cache dtype {self.layers[0].dtype}")
        self.arena.forget_residency(self.engine_slot)  # a previous engine's HBM tier died with it
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
            self.gpu = GpuInjector(
                self.arena, self.layers, self.repositioner, self.device_pages, self.promote_on_capture, engine_slot=self.engine_slot
            )
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
