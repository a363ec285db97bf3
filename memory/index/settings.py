"""IndexSettings: the vector index's configuration (the settings' `memory.index` block), pydantic only.

Imports no backend: reading the service settings loads neither torch nor cuVS.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class IndexSettings(BaseModel):
    """Vector index configuration (nested in the shard settings)."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["auto", "exact", "cagra"] = Field(
        "auto", description="auto: CAGRA when cuVS imports and a GPU is present, else exact torch search."
    )
    device: str = Field("auto", description="torch device of the index: auto (cuda if available), cpu, cuda, cuda:N.")
    cagra_min_vectors: int = Field(
        10_000, ge=256, description="Below this many live vectors CagraIndex answers with exact search (CAGRA cannot build on ~100)."
    )
    exact_user_max_vectors: int = Field(
        20_000, ge=0, description="Users with at most this many facts are searched exactly even when a graph exists."
    )
    graph_degree: int = Field(64, gt=0, description="CAGRA output graph degree.")
    intermediate_graph_degree: int = Field(128, gt=0, description="CAGRA kNN graph degree before pruning.")
    itopk_size: int = Field(128, gt=0, description="CAGRA search candidate list (raised to k rounded up to 32).")
    build_algo: Literal["ivf_pq", "nn_descent", "iterative_cagra_search"] = Field(
        "ivf_pq", description="CAGRA kNN-graph construction algorithm."
    )
    rebuild_tombstone_fraction: float = Field(
        0.2, gt=0, le=1, description="Rebuild the graph when deleted rows exceed this share of its rows."
    )
    extend_min_vectors: int = Field(
        1024, gt=0, description="New rows are searched exactly until this many are pending, then cagra.extend inserts them."
    )
