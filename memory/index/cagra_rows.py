"""RowSpace: CagraIndex's row store, one row per added vector, deleted rows kept as tombstones.

Rows [0, n_graph) are the ones a CAGRA graph was built or extended over (CagraIndex tracks
n_graph); rows after them are pending. A row never moves except in `compact`, which CagraIndex
calls only when no graph is kept (before a rebuild, or with no graph at all).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["RowSpace"]


class RowSpace:
    """Vectors on the device plus per-row user code, liveness and fact id on the host."""

    def __init__(self, dim: int, device: torch.device, capacity: int = 1024) -> None:
        self.dim = int(dim)
        self.device = device
        self.vectors = torch.empty((capacity, self.dim), dtype=torch.float32, device=device)
        self.fact: list[str | None] = []  # row -> fact id, None for a tombstone
        self.user = np.zeros(capacity, dtype=np.int32)  # row -> user code
        self.alive = np.zeros(capacity, dtype=np.bool_)
        self.n = 0  # rows in use, dead ones included
        self.n_dead = 0
        self.fact_row: dict[str, int] = {}  # live fact id -> row
        self.user_code: dict[str, int] = {}

    def code(self, user_id: str) -> int:
        """The user's small integer code (assigned on first sight, never reused)."""
        code = self.user_code.get(user_id)
        if code is None:
            code = self.user_code[user_id] = len(self.user_code)
        return code

    def reserve(self, n: int) -> None:
        cap = self.vectors.shape[0]
        if n <= cap:
            return
        new_cap = max(n, 2 * cap)
        rows = torch.empty((new_cap, self.dim), dtype=torch.float32, device=self.device)
        rows[: self.n] = self.vectors[: self.n]
        self.vectors = rows  # a graph keeps its own reference to the old storage
        self.user = np.resize(self.user, new_cap)
        alive = np.zeros(new_cap, dtype=np.bool_)
        alive[: self.n] = self.alive[: self.n]
        self.alive = alive

    def append(self, fact_ids: Sequence[str], user_ids: Sequence[str], vecs: torch.Tensor) -> None:
        """New live rows at the end (the facts must have no live row)."""
        n0, m = self.n, len(fact_ids)
        self.reserve(n0 + m)
        self.vectors[n0 : n0 + m] = vecs
        self.alive[n0 : n0 + m] = True
        for j, (fid, uid) in enumerate(zip(fact_ids, user_ids)):
            self.user[n0 + j] = self.code(uid)
            self.fact_row[fid] = n0 + j
        self.fact.extend(fact_ids)
        self.n = n0 + m

    def kill(self, fact_id: str) -> int | None:
        """Turn the fact's row into a tombstone; returns the row, None if the fact has none."""
        r = self.fact_row.pop(fact_id, None)
        if r is None:
            return None
        self.alive[r] = False
        self.fact[r] = None
        self.n_dead += 1
        return r

    def user_mask(self, code: int, start: int, stop: int) -> np.ndarray:
        """bool [stop - start]: rows start..stop-1 that are live and belong to the user code."""
        return (self.user[start:stop] == code) & self.alive[start:stop]

    def compact(self) -> None:
        """Drop the tombstones: live rows move to the front, in order."""
        n = self.n
        alive = np.flatnonzero(self.alive[:n])
        if alive.size == n:
            return
        idx = torch.from_numpy(alive).to(self.device)
        cap = max(1024, int(alive.size * 1.25))
        rows = torch.empty((cap, self.dim), dtype=torch.float32, device=self.device)
        rows[: alive.size] = self.vectors[idx]
        self.vectors = rows
        user = np.zeros(cap, dtype=np.int32)
        user[: alive.size] = self.user[alive]
        self.user = user
        self.alive = np.zeros(cap, dtype=np.bool_)
        self.alive[: alive.size] = True
        self.fact = [self.fact[i] for i in alive.tolist()]
        self.fact_row = {fid: r for r, fid in enumerate(self.fact)}  # type: ignore[misc]
        self.n = int(alive.size)
        self.n_dead = 0
