"""How an engine loads the connector: its typed configuration and the KVTransferConfig naming it.

ConnectorConfig is the connector's whole configuration, written into vLLM's
kv_connector_extra_config by kv_transfer_config (the replica's side) and read back, checked, once
by KVMemoryConnector (the engine core's side), as vLLM's own offloading connector reads its spec:
no key is spelt twice and an unknown key stops the engine with its name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvarena.tables import MAX_ENGINES

CONNECTOR_NAME = "KVMemoryConnector"
CONNECTOR_MODULE = "connector.kv_memory_connector"


class ConnectorConfig(BaseModel):
    """What one engine's KVMemoryConnector needs (pydantic: an unknown key, a missing arena or a
    value out of range is a ValidationError, a ValueError, naming the key)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arena_path: str = Field(..., min_length=1, description="The shard's fact arena (shared memory).")
    device_pages: int = Field(0, ge=0, description="HBM-tier pages on a GPU; 0: host tier only (CPU engines).")
    injector: Literal["auto", "torch"] = Field("auto", description="auto: the fused Triton path where it applies.")
    promote_on_capture: bool = Field(True, description="Captured pages enter the HBM tier while it has free slots.")
    engine_slot: int = Field(
        0, ge=0, lt=MAX_ENGINES, description="This engine's pin slot in the arena (kvarena.tables: one per engine serving it)."
    )

    def to_extra_config(self) -> dict[str, Any]:
        """vLLM's kv_connector_extra_config: the only place the keys are written."""
        return self.model_dump()

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> "ConnectorConfig":
        """The configuration kv_transfer_config wrote, checked: the only place the keys are read."""
        return cls.model_validate(dict(extra))


def kv_transfer_config(arena_path: Path | str, **extra: Any) -> Any:
    """KVTransferConfig that loads KVMemoryConnector over the arena at `arena_path`; `extra` are
    ConnectorConfig's other fields (device_pages, injector, promote_on_capture, engine_slot)."""
    from vllm.config import KVTransferConfig  # vLLM: not in `serve run`'s driver

    config = ConnectorConfig(arena_path=str(arena_path), **extra)
    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_connector_extra_config=config.to_extra_config(),
    )
