"""How an engine loads the connector: its typed configuration and the KVTransferConfig naming it.

ConnectorConfig is the connector's whole configuration, written into vLLM's
kv_connector_extra_config by kv_transfer_config (the replica's side) and read back, checked, once
by KVMemoryConnector (the engine core's side), as vLLM's own offloading connector reads its spec:
no key is spelt twice and an unknown key stops the engine with its name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

from kvarena.tables import MAX_ENGINES

CONNECTOR_NAME = "KVMemoryConnector"
CONNECTOR_MODULE = "connector.kv_memory_connector"


@dataclass(frozen=True)
class ConnectorConfig:
    """What one engine's KVMemoryConnector needs."""

    arena_path: str  # the shard's fact arena (shared memory)
    device_pages: int = 0  # HBM-tier pages on a GPU; 0: host tier only (CPU engines)
    injector: Literal["auto", "torch"] = "auto"  # auto: the fused Triton path where it applies
    promote_on_capture: bool = True  # captured pages enter the HBM tier while it has free slots
    engine_slot: int = 0  # this engine's pin slot in the arena (kvarena.tables: one per engine serving it)

    def __post_init__(self) -> None:
        if not self.arena_path:
            raise ValueError("KVMemoryConnector needs an arena_path")
        if self.device_pages < 0:
            raise ValueError(f"device_pages must be >= 0, got {self.device_pages}")
        if self.injector not in ("auto", "torch"):
            raise ValueError(f"injector must be auto or torch, got {self.injector!r}")
        if not 0 <= self.engine_slot < MAX_ENGINES:
            raise ValueError(f"engine_slot must be in 0..{MAX_ENGINES - 1}, got {self.engine_slot}")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> "ConnectorConfig":
        """The configuration kv_transfer_config wrote (an unknown key is a ValueError naming it)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**extra)


def kv_transfer_config(arena_path: Path | str, **extra: Any) -> Any:
    """KVTransferConfig that loads KVMemoryConnector over the arena at `arena_path`; `extra` are
    ConnectorConfig's other fields (device_pages, injector, promote_on_capture, engine_slot)."""
    from vllm.config import KVTransferConfig  # vLLM: not in `serve run`'s driver

    config = ConnectorConfig(arena_path=str(arena_path), **extra)
    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_connector_extra_config=asdict(config),
    )
