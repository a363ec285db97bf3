"""The vector index interface and its settings: `VectorIndex`, `SearchHit`, `IndexSettings`.

Torch-free on purpose (the HTTP ingress imports `IndexSettings` through the settings); the
backends live in `memory.index.exact` (torch) and `memory.index.cagra` (cuVS).

Scores are inner products of L2-normalised vectors (cosine similarity); every backend
normalises what it is given. Adding a fact id that is already present replaces its vector
(and its user). A search only ever sees the asking user's live facts; k larger than the
user's fact count returns all of them, best first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import numpy as np

__all__ = ["IndexSettings", "SearchHit", "VectorIndex"]


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One search result: the fact and its cosine similarity (inner product) to the query."""

    fact_id: str
    score: float


class VectorIndex(ABC):
    """User-filtered top-k over fact embeddings with incremental add, update and delete."""

    dim: int

    @abstractmethod
    def add(self, fact_ids: Sequence[str], user_ids: Sequence[str], vectors: np.ndarray) -> None:
        """Insert facts; an existing fact id is replaced (new vector, possibly new user)."""

    @abstractmethod
    def remove(self, fact_ids: Sequence[str]) -> int:
        """Delete facts; unknown ids are ignored. Returns how many were removed."""

    @abstractmethod
    def search(self, user_id: str, query: np.ndarray, k: int) -> list[list[SearchHit]]:
        """Top-k of `user_id`'s facts for each query ([d] or [q, d]); one list per query, best first."""

    @abstractmethod
    def __len__(self) -> int:
        """Live facts over all users."""

    @abstractmethod
    def count(self, user_id: str) -> int:
        """Live facts of one user."""

    @abstractmethod
    def clear_user(self, user_id: str) -> int:
        """Delete all of a user's facts. Returns how many were removed."""

    @abstractmethod
    def __contains__(self, fact_id: object) -> bool: ...

    @abstractmethod
    def user_of(self, fact_id: str) -> str | None:
        """The user owning a live fact, None if absent."""

    @abstractmethod
    def fact_ids(self, user_id: str) -> list[str]:
        """A user's live fact ids (no particular order)."""


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
