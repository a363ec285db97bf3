"""Per-request connector parameters (the `kvmem` key of kv_transfer_params) and step metadata.

A request names its memory operations in SamplingParams(extra_args={"kv_transfer_params":
{"kvmem": {...}}}) (or the `kv_transfer_params` field of an OpenAI request body):

    {"kvmem": {
        "inject":  [{"entry": 12, "generation": 3, "start": 40}, ...],
        "capture": {"entry": 7, "generation": 1, "start": 100}
    }}

inject:  arena entries whose KV stands for prompt tokens [start, start + entry length); the
         prompt must hold exactly the entry's tokens there (checked), and the request must carry
         a cache_salt (injected blocks enter the prefix cache under it).
capture: after the prompt is computed, copy the KV of prompt tokens [start, start + entry
         length) into the entry (allocated beforehand by the arena's owner).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

PARAMS_KEY = "kvmem"


class EntryPlacement(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    entry: int = Field(..., ge=0, description="Arena entry id.")
    generation: int = Field(..., ge=1, description="Generation the entry was allocated with.")
    start: int = Field(..., ge=0, description="Prompt position of the entry's first token.")


class KVMemoryParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inject: list[EntryPlacement] = Field(default_factory=list, description="Entries to inject.")
    capture: EntryPlacement | None = Field(None, description="Entry to fill from this prompt's KV.")

    @classmethod
    def from_kv_transfer_params(cls, kv_transfer_params: dict[str, Any] | None) -> "KVMemoryParams | None":
        """None when the request names no memory operation; raises ValidationError when malformed."""
        if not kv_transfer_params or PARAMS_KEY not in kv_transfer_params:
            return None
        return cls.model_validate(kv_transfer_params[PARAMS_KEY])

    def to_kv_transfer_params(self) -> dict[str, Any]:
        return {PARAMS_KEY: self.model_dump(exclude_none=True)}


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
