"""How an engine loads the connector: the KVTransferConfig naming this package's connector."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CONNECTOR_NAME = "KVMemoryConnector"
CONNECTOR_MODULE = "connector.kv_memory_connector"


def kv_transfer_config(arena_path: Path | str, **extra: Any) -> Any:
    """KVTransferConfig that loads KVMemoryConnector over the arena at `arena_path`.

    `extra` goes into kv_connector_extra_config: device_pages (HBM-tier pages on a GPU,
    default 0), injector ("auto" | "torch"), promote_on_capture (default True)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_connector_extra_config={"arena_path": str(arena_path), **extra},
    )
