"""Step metadata the connector's scheduler side hands its worker side each engine step.

Built by connector.scheduler from the requests' kvmem parameters (kvarena.params) and read by
connector.worker: which arena token slots go to which paged-cache slots, with which rotation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class InjectOp:
    """Copy arena token slots into paged-cache slots, rotating keys by `distances`."""

    req_id: str
    arena_slots: np.ndarray  # [T] int64, token axis of the arena
    cache_slots: np.ndarray  # [T] int64, block_id * block_size + offset
    distances: np.ndarray  # [T] int64, serving position - encode position


@dataclass
class CaptureOp:
    """Copy paged-cache slots into arena token slots (keys stay as computed)."""

    req_id: str
    cache_slots: np.ndarray
    arena_slots: np.ndarray
    entry: int = -1  # the target entry and generation: the worker writes only while it is still
    generation: int = 0  # WRITING (its owner may have released and re-allocated it meanwhile)


@dataclass
class KVMemoryConnectorMetadata(KVConnectorMetadata):
    injects: list[InjectOp] = field(default_factory=list)
    captures: list[CaptureOp] = field(default_factory=list)
