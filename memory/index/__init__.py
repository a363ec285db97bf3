"""Vector index over fact embeddings: one interface, two backends, user-filtered top-k.

    VectorIndex    the interface the memory shard uses (add / remove / search / count / clear_user)
    SearchHit      one result: fact id and cosine score
    IndexSettings  configuration (memory.index.settings); build_index(settings, dim) picks the backend
    ExactIndex     torch, CPU or GPU: one contiguous matrix per user (memory.index.exact)
    CagraIndex     cuVS CAGRA graph over all users' rows, GPU only (memory.index.cagra)
    cuvs_available whether cuVS imports and a GPU is present (memory.index.cuvs_interop)

Importing this package imports none of its modules: each name is loaded on first access, so
reading the settings (memory.index.settings) loads no backend, and `IndexSettings`, `SearchHit`,
`VectorIndex` from here import no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memory.index.base import SearchHit, VectorIndex
    from memory.index.cagra import CagraIndex
    from memory.index.cuvs_interop import cuvs_available
    from memory.index.exact import ExactIndex
    from memory.index.factory import build_index
    from memory.index.settings import IndexSettings

__all__ = [
    "CagraIndex",
    "ExactIndex",
    "IndexSettings",
    "SearchHit",
    "VectorIndex",
    "build_index",
    "cuvs_available",
]

_LAZY = {
    "IndexSettings": "memory.index.settings",
    "SearchHit": "memory.index.base",
    "VectorIndex": "memory.index.base",
    "CagraIndex": "memory.index.cagra",
    "ExactIndex": "memory.index.exact",
    "build_index": "memory.index.factory",
    "cuvs_available": "memory.index.cuvs_interop",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
