"""ExactIndex: exact user-filtered top-k with torch (CPU or GPU), one matrix per user.

Also the tensor helpers every torch backend shares: device resolution, input validation and
normalisation, add-batch de-duplication, and turning (scores, columns) into `SearchHit`s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from memory.index.base import SearchHit, VectorIndex

__all__ = ["ExactIndex", "as_matrix", "dedupe_last", "resolve_device", "to_hits"]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None or "auto" -> cuda when available, else cpu; anything else as torch reads it."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def as_matrix(x: Any, dim: int, device: torch.device, normalize: bool) -> torch.Tensor:
    """[d] or [n, d] array/tensor -> float32 [n, d] tensor on `device`, rows L2-normalised."""
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.shape[1] != dim:
        raise ValueError(f"expected vectors of shape [n, {dim}] or [{dim}], got {tuple(t.shape)}")
    t = t.to(device=device, dtype=torch.float32)
    if normalize:
        t = t / t.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return t.contiguous()


def dedupe_last(fact_ids: Sequence[str], user_ids: Sequence[str], n_rows: int) -> tuple[list[int], list[str], list[str]]:
    """Validate an add batch; a fact id given twice keeps its last row (sequential semantics)."""
    if len(fact_ids) != n_rows or len(user_ids) != n_rows:
        raise ValueError(f"{len(fact_ids)} fact ids, {len(user_ids)} user ids, {n_rows} vectors: lengths differ")
    last: dict[str, int] = {}
    for i, fid in enumerate(fact_ids):
        last[str(fid)] = i
    keep = sorted(last.values())
    return keep, [str(fact_ids[i]) for i in keep], [str(user_ids[i]) for i in keep]


def to_hits(scores: torch.Tensor, cols: torch.Tensor, ids_of: Callable[[int], Any]) -> list[list[SearchHit]]:
    """[q, k] scores and row/column indices -> one list of SearchHit per query."""
    s = scores.cpu().tolist()
    c = cols.cpu().tolist()
    return [[SearchHit(ids_of(j), float(v)) for v, j in zip(sr, cr)] for sr, cr in zip(s, c)]


class _UserBlock:
    """One user's rows: a contiguous [capacity, d] matrix, the first n rows live."""

    __slots__ = ("mat", "n", "ids", "pos")

    def __init__(self, dim: int, device: torch.device, capacity: int) -> None:
        self.mat = torch.empty((capacity, dim), dtype=torch.float32, device=device)
        self.n = 0
        self.ids: list[str] = []
        self.pos: dict[str, int] = {}

    def reserve(self, n: int) -> None:
        cap = self.mat.shape[0]
        if n <= cap:
            return
        new_cap = max(n, 2 * cap)
        mat = torch.empty((new_cap, self.mat.shape[1]), dtype=self.mat.dtype, device=self.mat.device)
        mat[: self.n] = self.mat[: self.n]
        self.mat = mat

    def swap_remove(self, fact_id: str) -> None:
        r = self.pos.pop(fact_id)
        last = self.n - 1
        if r != last:
            self.mat[r] = self.mat[last]
            moved = self.ids[last]
            self.ids[r] = moved
            self.pos[moved] = r
        self.mat[last].zero_()  # the vacated row keeps no copy of a deleted fact's embedding
        self.ids.pop()
        self.n = last


class ExactIndex(VectorIndex):
    """Exact inner-product search with torch, one contiguous matrix per user.

    A per-user matrix (rather than one global matrix and a user mask) makes a search cost
    O(user's facts), independent of how many other users share the shard. Deletes swap the
    user's last row into the hole, so the matrix stays dense.
    """

    def __init__(self, dim: int, device: str | torch.device = "cpu", *, normalize: bool = True, initial_capacity: int = 64) -> None:
        self.dim = int(dim)
        self.device = resolve_device(device)
        self.normalize = normalize
        self._initial_capacity = max(1, int(initial_capacity))
        self._users: dict[str, _UserBlock] = {}
        self._owner: dict[str, str] = {}
        self._lock = threading.RLock()

    # -- mutation
    def add(self, fact_ids: Sequence[str], user_ids: Sequence[str], vectors: Any) -> None:
        vecs = as_matrix(vectors, self.dim, self.device, self.normalize)
        keep, fids, uids = dedupe_last(fact_ids, user_ids, vecs.shape[0])
        if len(keep) != vecs.shape[0]:
            vecs = vecs[torch.as_tensor(keep, device=self.device)]
        with self._lock:
            appends: dict[str, list[int]] = {}
            for i, (fid, uid) in enumerate(zip(fids, uids)):
                owner = self._owner.get(fid)
                if owner == uid:
                    block = self._users[uid]
                    block.mat[block.pos[fid]] = vecs[i]  # update in place
                    continue
                if owner is not None:
                    self._remove_one(fid, owner)
                appends.setdefault(uid, []).append(i)
            for uid, rows in appends.items():
                block = self._users.get(uid)
                if block is None:
                    block = self._users[uid] = _UserBlock(self.dim, self.device, max(self._initial_capacity, len(rows)))
                block.reserve(block.n + len(rows))
                src = vecs[rows[0] : rows[-1] + 1] if rows == list(range(rows[0], rows[-1] + 1)) else vecs[torch.as_tensor(rows, device=self.device)]
                block.mat[block.n : block.n + len(rows)] = src
                for j, i in enumerate(rows):
                    fid = fids[i]
                    block.ids.append(fid)
                    block.pos[fid] = block.n + j
                    self._owner[fid] = uid
                block.n += len(rows)

    def _remove_one(self, fact_id: str, owner: str) -> None:
        block = self._users[owner]
        block.swap_remove(fact_id)
        del self._owner[fact_id]
        if block.n == 0:
            del self._users[owner]

    def remove(self, fact_ids: Sequence[str]) -> int:
        removed = 0
        with self._lock:
            for fid in fact_ids:
                owner = self._owner.get(str(fid))
                if owner is not None:
                    self._remove_one(str(fid), owner)
                    removed += 1
        return removed

    def clear_user(self, user_id: str) -> int:
        with self._lock:
            block = self._users.pop(user_id, None)
            if block is None:
                return 0
            for fid in block.ids:
                del self._owner[fid]
            return block.n

    # -- queries
    def search(self, user_id: str, query: Any, k: int) -> list[list[SearchHit]]:
        q = as_matrix(query, self.dim, self.device, self.normalize)
        return self.search_normalized(user_id, q, k)

    def search_normalized(self, user_id: str, q: torch.Tensor, k: int) -> list[list[SearchHit]]:
        """search() for queries already on the index's device as float32 [q, d] (normalised if wanted)."""
        with self._lock:
            block = self._users.get(user_id)
            if block is None or k <= 0:
                return [[] for _ in range(q.shape[0])]
            kk = min(int(k), block.n)
            scores = q @ block.mat[: block.n].T  # [q, n]
            top, cols = torch.topk(scores, kk, dim=1)
            ids = block.ids
            return to_hits(top, cols, ids.__getitem__)

    def __len__(self) -> int:
        return len(self._owner)

    def count(self, user_id: str) -> int:
        block = self._users.get(user_id)
        return 0 if block is None else block.n

    def __contains__(self, fact_id: object) -> bool:
        return fact_id in self._owner

    def user_of(self, fact_id: str) -> str | None:
        return self._owner.get(fact_id)

    def fact_ids(self, user_id: str) -> list[str]:
        block = self._users.get(user_id)
        return [] if block is None else list(block.ids)

    def vector(self, fact_id: str) -> np.ndarray | None:
        """The stored (normalised) vector of a fact, None if absent."""
        with self._lock:
            owner = self._owner.get(fact_id)
            if owner is None:
                return None
            block = self._users[owner]
            return block.mat[block.pos[fact_id]].cpu().numpy().copy()
