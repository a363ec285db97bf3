"""Vector index over fact embeddings: one interface, two backends, user-filtered top-k.

    VectorIndex   the interface the memory shard uses (add / remove / search / count / clear_user)
    ExactIndex    torch, CPU or GPU: one contiguous matrix per user, inner product + topk
    CagraIndex    cuVS CAGRA graph over all users' rows (GPU only, optional dependency) with an
                  ExactIndex next to it for small indexes and small users
    IndexSettings configuration; build_index(settings, dim) picks the backend

Scores are inner products of L2-normalised vectors (cosine similarity); both backends
normalise what they are given. Adding a fact id that is already present replaces its vector
(and its user). A search only ever sees the asking user's live facts; k larger than the
user's fact count returns all of them, best first.

CagraIndex routing (per search):
  1. no graph (fewer live vectors than `cagra_min_vectors`; CAGRA cannot build on ~100
     vectors and is slower than a matmul on a few thousand)      -> exact over the user's rows;
  2. the user has at most `exact_user_max_vectors` live facts, or k >= that count
                                                                 -> exact over the user's rows
     (one [n, d] x [d] matmul on the GPU: cheaper than a graph walk whose filter rejects
     almost every visited node when the user owns a small share of the index);
  3. otherwise -> CAGRA search with a bitset prefilter (the user's live graph rows), plus exact
     search over the user's rows added since the last extend, merged and re-scored exactly.
Deletes are tombstones in the graph (cleared from every bitset); when tombstones exceed
`rebuild_tombstone_fraction` of the graph rows the graph is rebuilt from the live rows.
New rows are searched exactly until `extend_min_vectors` of them are pending, then they are
inserted with cagra.extend.

The module needs numpy, torch and pydantic; cuVS is an optional import. The GPU benchmark
(bench/cagra_h200.py) needs nothing else of the project.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "CagraIndex",
    "ExactIndex",
    "IndexSettings",
    "SearchHit",
    "VectorIndex",
    "build_index",
    "cuvs_available",
]


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One search result: the fact and its cosine similarity (inner product) to the query."""

    fact_id: str
    score: float


# ----------------------------------------------------------------------------- helpers


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _as_matrix(x: Any, dim: int, device: torch.device, normalize: bool) -> torch.Tensor:
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


def _dedupe_last(fact_ids: Sequence[str], user_ids: Sequence[str], n_rows: int) -> tuple[list[int], list[str], list[str]]:
    """Validate an add batch; a fact id given twice keeps its last row (sequential semantics)."""
    if len(fact_ids) != n_rows or len(user_ids) != n_rows:
        raise ValueError(f"{len(fact_ids)} fact ids, {len(user_ids)} user ids, {n_rows} vectors: lengths differ")
    last: dict[str, int] = {}
    for i, fid in enumerate(fact_ids):
        last[str(fid)] = i
    keep = sorted(last.values())
    return keep, [str(fact_ids[i]) for i in keep], [str(user_ids[i]) for i in keep]


def _hits(scores: torch.Tensor, cols: torch.Tensor, ids_of: Any) -> list[list[SearchHit]]:
    s = scores.cpu().tolist()
    c = cols.cpu().tolist()
    return [[SearchHit(ids_of(j), float(v)) for v, j in zip(sr, cr)] for sr, cr in zip(s, c)]


# ----------------------------------------------------------------------------- interface


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


# ----------------------------------------------------------------------------- exact backend


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
        self.device = _resolve_device(device)
        self.normalize = normalize
        self._initial_capacity = max(1, int(initial_capacity))
        self._users: dict[str, _UserBlock] = {}
        self._owner: dict[str, str] = {}
        self._lock = threading.RLock()

    # -- mutation
    def add(self, fact_ids: Sequence[str], user_ids: Sequence[str], vectors: Any) -> None:
        vecs = _as_matrix(vectors, self.dim, self.device, self.normalize)
        keep, fids, uids = _dedupe_last(fact_ids, user_ids, vecs.shape[0])
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
        q = _as_matrix(query, self.dim, self.device, self.normalize)
        return self._search_normalized(user_id, q, k)

    def _search_normalized(self, user_id: str, q: torch.Tensor, k: int) -> list[list[SearchHit]]:
        with self._lock:
            block = self._users.get(user_id)
            if block is None or k <= 0:
                return [[] for _ in range(q.shape[0])]
            kk = min(int(k), block.n)
            scores = q @ block.mat[: block.n].T  # [q, n]
            top, cols = torch.topk(scores, kk, dim=1)
            ids = block.ids
            return _hits(top, cols, ids.__getitem__)

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


# ----------------------------------------------------------------------------- CAGRA backend


def _import_cuvs() -> tuple[Any, Any]:
    from cuvs.neighbors import cagra, filters  # optional dependency (cuvs-cu13 / cuvs-cu12)

    return cagra, filters


def cuvs_available() -> bool:
    """True when cuVS imports and torch sees a CUDA device."""
    try:
        _import_cuvs()
    except Exception:
        return False
    return torch.cuda.is_available()


def _to_numpy(x: Any) -> np.ndarray:
    """cuVS outputs (pylibraft device_ndarray, cupy, torch or numpy) -> host numpy."""
    if isinstance(x, torch.Tensor):
        return x.cpu().numpy()
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if hasattr(x, "get"):
        return x.get()
    return np.asarray(x)


class _U32Words:
    """A torch int32 CUDA tensor presented to cuVS as uint32 words (bitsets are uint32)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t

    @property
    def __cuda_array_interface__(self) -> dict:
        cai = dict(self.tensor.__cuda_array_interface__)
        cai["typestr"] = "<u4"
        return cai

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


def _pack_bits(mask: np.ndarray) -> np.ndarray:
    """bool [n] -> uint32 words, bit i of word j = row 32 j + i (cuVS bitset layout)."""
    packed = np.packbits(mask.astype(np.bool_), bitorder="little")
    pad = (-packed.size) % 4
    if pad:
        packed = np.concatenate([packed, np.zeros(pad, dtype=np.uint8)])
    if packed.size == 0:
        packed = np.zeros(4, dtype=np.uint8)
    return packed.view("<u4")


class CagraIndex(VectorIndex):
    """cuVS CAGRA over every user's rows, user-filtered with a bitset prefilter (GPU only).

    See the module docstring for the routing rule. An ExactIndex on the same GPU holds every
    live fact too (it answers small indexes and small users), so a search is always correct
    even when the graph could not be built (the error is kept in `last_error`).
    """

    def __init__(
        self,
        dim: int,
        device: str | torch.device = "cuda",
        *,
        cagra_min_vectors: int = 10_000,
        exact_user_max_vectors: int = 20_000,
        graph_degree: int = 64,
        intermediate_graph_degree: int = 128,
        itopk_size: int = 128,
        build_algo: str = "ivf_pq",
        rebuild_tombstone_fraction: float = 0.2,
        extend_min_vectors: int = 1024,
        normalize: bool = True,
        cuvs_modules: tuple[Any, Any] | None = None,
    ) -> None:
        # cuvs_modules: (cagra, filters) stand-ins; only the CPU unit tests pass them.
        self.cagra, self.filters = cuvs_modules if cuvs_modules is not None else _import_cuvs()
        self.device = _resolve_device(device)
        if self.device.type != "cuda" and cuvs_modules is None:
            raise ValueError(f"CagraIndex needs a CUDA device, got {self.device}")
        self.dim = int(dim)
        self.normalize = normalize
        self.cagra_min_vectors = max(int(cagra_min_vectors), 256)
        self.exact_user_max_vectors = int(exact_user_max_vectors)
        self.graph_degree = int(graph_degree)
        self.intermediate_graph_degree = int(intermediate_graph_degree)
        self.itopk_size = int(itopk_size)
        self.build_algo = build_algo
        self.rebuild_tombstone_fraction = float(rebuild_tombstone_fraction)
        self.extend_min_vectors = max(1, int(extend_min_vectors))
        self._exact = ExactIndex(dim, self.device, normalize=False)
        self._lock = threading.RLock()
        # Graph row space: rows [0, n_graph) are in the graph, [n_graph, n_rows) pending.
        self._rows = torch.empty((1024, self.dim), dtype=torch.float32, device=self.device)
        self._row_fact: list[str | None] = []
        self._row_user = np.zeros(1024, dtype=np.int32)
        self._row_alive = np.zeros(1024, dtype=np.bool_)
        self._n_rows = 0
        self._n_graph = 0
        self._n_dead = 0
        self._fact_row: dict[str, int] = {}
        self._user_code: dict[str, int] = {}
        self._index: Any = None
        self._graph_dataset: Any = None  # keeps the tensor the graph views alive
        self._bitsets: dict[int, Any] = {}
        self._alive_bitset: Any = None
        self._search_params: dict[int, Any] = {}
        self._extend_style: str | None = None
        self.last_error: str | None = None
        self._failed_at: int | None = None
        self.stats: dict[str, float] = {"builds": 0, "extends": 0, "last_build_s": 0.0, "last_extend_s": 0.0}

    # -- bookkeeping
    def _sync(self) -> None:
        """cuVS runs on its own stream: finish torch's writes to rows/queries first."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _on_device(self) -> Any:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    @property
    def has_graph(self) -> bool:
        return self._index is not None

    @property
    def graph_rows(self) -> int:
        return self._n_graph

    @property
    def pending_rows(self) -> int:
        return self._n_rows - self._n_graph

    @property
    def tombstones(self) -> int:
        return self._n_dead

    def _code(self, user_id: str) -> int:
        code = self._user_code.get(user_id)
        if code is None:
            code = self._user_code[user_id] = len(self._user_code)
        return code

    def _reserve_rows(self, n: int) -> None:
        cap = self._rows.shape[0]
        if n <= cap:
            return
        new_cap = max(n, 2 * cap)
        rows = torch.empty((new_cap, self.dim), dtype=torch.float32, device=self.device)
        rows[: self._n_rows] = self._rows[: self._n_rows]
        self._rows = rows  # the graph keeps its own reference to the old storage
        self._row_user = np.resize(self._row_user, new_cap)
        alive = np.zeros(new_cap, dtype=np.bool_)
        alive[: self._n_rows] = self._row_alive[: self._n_rows]
        self._row_alive = alive

    def _tombstone(self, fact_id: str) -> None:
        r = self._fact_row.pop(fact_id, None)
        if r is None:
            return
        self._row_alive[r] = False
        self._row_fact[r] = None
        self._n_dead += 1
        if r < self._n_graph:
            self._bitsets.pop(int(self._row_user[r]), None)
            self._alive_bitset = None

    # -- mutation
    def add(self, fact_ids: Sequence[str], user_ids: Sequence[str], vectors: Any) -> None:
        vecs = _as_matrix(vectors, self.dim, self.device, self.normalize)
        keep, fids, uids = _dedupe_last(fact_ids, user_ids, vecs.shape[0])
        if len(keep) != vecs.shape[0]:
            vecs = vecs[torch.as_tensor(keep, device=self.device)]
        with self._lock:
            self._exact.add(fids, uids, vecs)
            for fid in fids:
                self._tombstone(fid)
            n0, m = self._n_rows, len(fids)
            self._reserve_rows(n0 + m)
            self._rows[n0 : n0 + m] = vecs
            self._row_alive[n0 : n0 + m] = True
            for j, (fid, uid) in enumerate(zip(fids, uids)):
                self._row_user[n0 + j] = self._code(uid)
                self._fact_row[fid] = n0 + j
            self._row_fact.extend(fids)
            self._n_rows = n0 + m
            self._maintain()

    def remove(self, fact_ids: Sequence[str]) -> int:
        with self._lock:
            fids = [str(f) for f in fact_ids]
            removed = self._exact.remove(fids)
            for fid in fids:
                self._tombstone(fid)
            self._maintain()
            return removed

    def clear_user(self, user_id: str) -> int:
        with self._lock:
            fids = self._exact.fact_ids(user_id)
            removed = self._exact.clear_user(user_id)
            for fid in fids:
                self._tombstone(fid)
            self._maintain()
            return removed

    def flush(self) -> None:
        """Build the graph, or extend it with every pending row, now (if the index is big enough)."""
        with self._lock:
            self._maintain(force=True)

    def rebuild(self) -> None:
        """Compact away tombstones and rebuild the graph from the live rows."""
        with self._lock:
            self._rebuild()

    def _maintain(self, force: bool = False) -> None:
        live = len(self._exact)
        if self._index is None:
            # After a failed build, retry only when forced or once the index has doubled.
            if live >= self.cagra_min_vectors and (force or self._failed_at is None or live >= 2 * self._failed_at):
                self._rebuild()
            elif self._n_dead > self.rebuild_tombstone_fraction * max(self._n_rows, 1):
                self._compact()  # no graph to rebuild, but deleted rows must not pile up
            return
        if live < self.cagra_min_vectors // 2:  # shrank far below the threshold: back to exact only
            self._drop_graph()
            return
        if self._n_dead > self.rebuild_tombstone_fraction * max(self._n_rows, 1):
            self._rebuild()
        elif self.pending_rows >= self.extend_min_vectors or (force and self.pending_rows > 0):
            self._extend()

    def _drop_graph(self) -> None:
        self._index = None
        self._graph_dataset = None
        self._n_graph = 0
        self._bitsets.clear()
        self._alive_bitset = None

    def _compact(self) -> None:
        n = self._n_rows
        alive = np.flatnonzero(self._row_alive[:n])
        if alive.size == n:
            return
        idx = torch.from_numpy(alive).to(self.device)
        cap = max(1024, int(alive.size * 1.25))
        rows = torch.empty((cap, self.dim), dtype=torch.float32, device=self.device)
        rows[: alive.size] = self._rows[idx]
        self._rows = rows
        user = np.zeros(cap, dtype=np.int32)
        user[: alive.size] = self._row_user[alive]
        self._row_user = user
        self._row_alive = np.zeros(cap, dtype=np.bool_)
        self._row_alive[: alive.size] = True
        self._row_fact = [self._row_fact[i] for i in alive.tolist()]
        self._fact_row = {fid: r for r, fid in enumerate(self._row_fact)}  # type: ignore[misc]
        self._n_rows = int(alive.size)
        self._n_dead = 0

    def _rebuild(self) -> None:
        self._compact()
        self._drop_graph()
        n = self._n_rows
        if n < self.cagra_min_vectors:
            return
        dataset = self._rows[:n]
        t0 = time.perf_counter()
        try:
            params = self.cagra.IndexParams(
                metric="sqeuclidean",  # = inner-product order on unit vectors; scores re-computed exactly
                graph_degree=self.graph_degree,
                intermediate_graph_degree=self.intermediate_graph_degree,
                build_algo=self.build_algo,
            )
            self._sync()
            with self._on_device():
                index = self.cagra.build(params, dataset)
        except Exception as exc:  # keep serving exactly; the error is visible to callers
            self.last_error = f"cagra.build({n} rows): {type(exc).__name__}: {exc}"
            self._failed_at = n
            warnings.warn(self.last_error, RuntimeWarning, stacklevel=3)
            return
        self._index = index
        self._graph_dataset = dataset
        self._n_graph = n
        self.last_error = None
        self._failed_at = None
        self.stats["builds"] += 1
        self.stats["last_build_s"] = time.perf_counter() - t0

    def _extend(self) -> None:
        n_old, n_new = self._n_graph, self._n_rows
        full = self._rows[:n_new]
        params = self.cagra.ExtendParams()
        t0 = time.perf_counter()
        try:
            self._sync()
            with self._on_device():
                out = self._call_extend(params, full, n_old, n_new)
        except Exception as exc:
            self.last_error = f"cagra.extend({n_old}+{n_new - n_old} rows): {type(exc).__name__}: {exc}; rebuilding"
            warnings.warn(self.last_error, RuntimeWarning, stacklevel=3)
            self._rebuild()
            return
        if out is not None:
            self._index = out
        self._graph_dataset = full
        self._n_graph = n_new
        self._bitsets.clear()
        self._alive_bitset = None
        self.stats["extends"] += 1
        self.stats["last_extend_s"] = time.perf_counter() - t0

    def _call_extend(self, params: Any, full: torch.Tensor, n_old: int, n_new: int) -> Any:
        """cuVS >= 26.10: extend(params, index, old || new rows, new_start_row) rebinding the index;
        older: extend(params, index, new rows) -> index. The form is read off the signature
        (or docstring), else tried: new first, the old one on a TypeError."""
        style = self._extend_style
        if style is None:
            try:
                names = set(inspect.signature(self.cagra.extend).parameters)
            except (TypeError, ValueError):
                names = set()
            if "new_start_row" in names or "new_start_row" in (getattr(self.cagra.extend, "__doc__", "") or ""):
                style = "new"
            elif "additional_dataset" in names:
                style = "old"
        if style in (None, "new"):
            try:
                out = self.cagra.extend(params, self._index, full, new_start_row=n_old)
                self._extend_style = "new"
                return out
            except TypeError:
                if style == "new":
                    raise
        out = self.cagra.extend(params, self._index, self._rows[n_old:n_new].contiguous())
        self._extend_style = "old"
        return out

    # -- queries
    def route(self, user_id: str, k: int) -> Literal["exact", "cagra"]:
        """Which path a search for this user and k takes (see the module docstring)."""
        n = self._exact.count(user_id)
        if self._index is None or n <= self.exact_user_max_vectors or k >= n:
            return "exact"
        return "cagra"

    def search(self, user_id: str, query: Any, k: int, *, route: Literal["exact", "cagra"] | None = None) -> list[list[SearchHit]]:
        """User-filtered top-k; `route` forces a path (benchmarks), None applies the rule."""
        q = _as_matrix(query, self.dim, self.device, self.normalize)
        with self._lock:
            n = self._exact.count(user_id)
            if n == 0 or k <= 0:
                return [[] for _ in range(q.shape[0])]
            path = route or self.route(user_id, k)
            if path == "exact" or self._index is None:
                return self._exact._search_normalized(user_id, q, k)
            code = self._user_code[user_id]
            bitset = self._bitsets.get(code)
            if bitset is None:
                mask = (self._row_user[: self._n_graph] == code) & self._row_alive[: self._n_graph]
                bitset = self._bitsets[code] = self._upload_bits(mask)
            pend = np.flatnonzero(
                (self._row_user[self._n_graph : self._n_rows] == code) & self._row_alive[self._n_graph : self._n_rows]
            ) + self._n_graph
            return self._graph_search(q, min(int(k), n), bitset, pend, allowed_user=code)

    def search_all(self, query: Any, k: int, *, route: Literal["exact", "cagra"] | None = None) -> list[list[SearchHit]]:
        """Unfiltered top-k over every user's live facts (benchmarks and diagnostics)."""
        q = _as_matrix(query, self.dim, self.device, self.normalize)
        with self._lock:
            live = len(self._exact)
            if live == 0 or k <= 0:
                return [[] for _ in range(q.shape[0])]
            kk = min(int(k), live)
            if route == "exact" or self._index is None:
                if self._n_dead == 0:
                    top, rows = torch.topk(q @ self._rows[: self._n_rows].T, kk, dim=1)
                else:
                    alive = torch.from_numpy(np.flatnonzero(self._row_alive[: self._n_rows])).to(self.device)
                    top, cols = torch.topk(q @ self._rows[alive].T, kk, dim=1)
                    rows = alive[cols]
                return _hits(top, rows, self._row_fact.__getitem__)
            bitset = None
            if self._n_dead:
                if self._alive_bitset is None:
                    self._alive_bitset = self._upload_bits(self._row_alive[: self._n_graph])
                bitset = self._alive_bitset
            pend = np.flatnonzero(self._row_alive[self._n_graph : self._n_rows]) + self._n_graph
            return self._graph_search(q, kk, bitset, pend, allowed_user=None)

    def _upload_bits(self, mask: np.ndarray) -> Any:
        words = _pack_bits(mask)
        return _U32Words(torch.from_numpy(words.view(np.int32).copy()).to(self.device))

    def _params(self, k: int) -> Any:
        itopk = max(self.itopk_size, -(-k // 32) * 32)
        sp = self._search_params.get(itopk)
        if sp is None:
            sp = self._search_params[itopk] = self.cagra.SearchParams(itopk_size=itopk)
        return sp

    def raw_search(self, q: torch.Tensor, k: int, bitset: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """cagra.search on normalised [q, d] CUDA queries -> (distances, graph rows) on the host."""
        kwargs = {} if bitset is None else {"filter": self.filters.from_bitset(bitset)}
        self._sync()
        with self._on_device():
            d, nb = self.cagra.search(self._params(k), self._index, q, k, **kwargs)
        return _to_numpy(d), _to_numpy(nb).astype(np.int64, copy=False)

    def _graph_search(self, q: torch.Tensor, k: int, bitset: Any, pend: np.ndarray, allowed_user: int | None) -> list[list[SearchHit]]:
        nq = q.shape[0]
        kg = min(k, self._n_graph)
        _, nb = self.raw_search(q, kg, bitset)
        # Drop what the graph may return past the allowed set (invalid ids when fewer than k pass).
        valid = (nb >= 0) & (nb < self._n_graph)
        safe = np.where(valid, nb, 0)
        valid &= self._row_alive[safe]
        if allowed_user is not None:
            valid &= self._row_user[safe] == allowed_user
        cand = np.concatenate([safe, np.broadcast_to(pend, (nq, pend.size))], axis=1)
        ok = np.concatenate([valid, np.ones((nq, pend.size), dtype=np.bool_)], axis=1)
        # Re-score candidates exactly (cosine) and keep the best k.
        cand_t = torch.from_numpy(np.ascontiguousarray(cand)).to(self.device)
        ok_t = torch.from_numpy(np.ascontiguousarray(ok)).to(self.device)
        scores = torch.einsum("qmd,qd->qm", self._rows[cand_t], q)
        scores = scores.masked_fill(~ok_t, float("-inf"))
        top, pos = torch.topk(scores, min(k, cand.shape[1]), dim=1)
        rows = torch.gather(cand_t, 1, pos)
        top_l, rows_l = top.cpu().tolist(), rows.cpu().tolist()
        out: list[list[SearchHit]] = []
        seen_fact = self._row_fact
        for sr, rr in zip(top_l, rows_l):
            hits: list[SearchHit] = []
            seen: set[int] = set()
            for s, r in zip(sr, rr):
                if s == float("-inf") or r in seen:
                    continue
                seen.add(r)
                hits.append(SearchHit(seen_fact[r], float(s)))  # type: ignore[arg-type]
            out.append(hits)
        return out

    def __len__(self) -> int:
        return len(self._exact)

    def count(self, user_id: str) -> int:
        return self._exact.count(user_id)

    def __contains__(self, fact_id: object) -> bool:
        return fact_id in self._exact

    def user_of(self, fact_id: str) -> str | None:
        return self._exact.user_of(fact_id)

    def fact_ids(self, user_id: str) -> list[str]:
        return self._exact.fact_ids(user_id)


# ----------------------------------------------------------------------------- settings


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


def build_index(settings: IndexSettings, dim: int) -> VectorIndex:
    """The backend the settings ask for; "auto" = CAGRA when cuVS and a GPU are present, else exact."""
    device = _resolve_device(settings.device)
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
