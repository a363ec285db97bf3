"""build_index: the VectorIndex backend that an IndexSettings asks for (imports torch)."""

from __future__ import annotations

from memory.index.base import VectorIndex
from memory.index.cagra import CagraIndex
from memory.index.cuvs_interop import cuvs_available
from memory.index.exact import ExactIndex, resolve_device
from memory.index.settings import IndexSettings

__all__ = ["build_index"]


def build_index(settings: IndexSettings, dim: int) -> VectorIndex:
    """The backend the settings ask for; "auto" = CAGRA when cuVS and a GPU are present, else exact."""
    device = resolve_device(settings.device)
    backend = settings.backend
    if backend == "auto":
        backend = "cagra" if device.type == "cuda" and cuvs_available() else "exact"
    if backend == "exact":
        return ExactIndex(dim, device)
    if device.type != "cuda":
        raise ValueError("backend 'cagra' needs a CUDA device")
    return CagraIndex(
        dim,
        device,
        cagra_min_vectors=settings.cagra_min_vectors,
        exact_user_max_vectors=settings.exact_user_max_vectors,
        graph_degree=settings.graph_degree,
        intermediate_graph_degree=settings.intermediate_graph_degree,
        itopk_size=settings.itopk_size,
        build_algo=settings.build_algo,
        rebuild_tombstone_fraction=settings.rebuild_tombstone_fraction,
        extend_min_vectors=settings.extend_min_vectors,
    )
