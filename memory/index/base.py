"""The vector index interface: `VectorIndex`, `SearchHit` (its settings: memory.index.settings).

Torch-free on purpose; the
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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["SearchHit", "VectorIndex"]


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
