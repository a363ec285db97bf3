"""CagraIndex: a cuVS CAGRA graph over all users' rows (GPU only), user-filtered by a bitset.

An ExactIndex next to it holds every live fact too and answers small indexes and small users.
Routing (per search):
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

Needs numpy, torch and pydantic; cuVS is imported when a CagraIndex is made. The GPU benchmark
(bench/retrieval/cagra_h200.py) needs nothing else of the project.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from memory.index.base import SearchHit, VectorIndex
from memory.index.cagra_rows import RowSpace
from memory.index.cuvs_interop import U32Words, call_extend, import_cuvs, pack_bits, to_numpy
from memory.index.exact import ExactIndex, as_matrix, dedupe_last, resolve_device, to_hits

__all__ = ["CagraIndex"]


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
        self.cagra, self.filters = cuvs_modules if cuvs_modules is not None else import_cuvs()
        self.device = resolve_device(device)
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
        # Graph row space: rows [0, n_graph) are in the graph, [n_graph, space.n) pending.
        self._space = RowSpace(self.dim, self.device)
        self._n_graph = 0
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
        return self._space.n - self._n_graph

    @property
    def tombstones(self) -> int:
        return self._space.n_dead

    @property
    def stored_rows(self) -> int:
        """Rows in the row space: graph and pending rows, tombstones included."""
        return self._space.n

    @property
    def extend_style(self) -> str | None:
        """The cagra.extend form in use: "new" (cuVS >= 26.10), "old", or None before the first extend."""
        return self._extend_style

    def set_itopk_size(self, itopk_size: int) -> None:
        """Change the search candidate list size (benchmarks sweep it)."""
        self.itopk_size = int(itopk_size)
        self._search_params.clear()

    def _tombstone(self, fact_id: str) -> None:
        r = self._space.kill(fact_id)
        if r is not None and r < self._n_graph:
            self._bitsets.pop(int(self._space.user[r]), None)
            self._alive_bitset = None

    # -- mutation
    def add(self, fact_ids: Sequence[str], user_ids: Sequence[str], vectors: Any) -> None:
        vecs = as_matrix(vectors, self.dim, self.device, self.normalize)
        keep, fids, uids = dedupe_last(fact_ids, user_ids, vecs.shape[0])
        if len(keep) != vecs.shape[0]:
            vecs = vecs[torch.as_tensor(keep, device=self.device)]
        with self._lock:
            self._exact.add(fids, uids, vecs)
            for fid in fids:
                self._tombstone(fid)
            self._space.append(fids, uids, vecs)
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

    def _too_many_dead(self) -> bool:
        return self._space.n_dead > self.rebuild_tombstone_fraction * max(self._space.n, 1)

    def _maintain(self, force: bool = False) -> None:
        live = len(self._exact)
        if self._index is None:
            # After a failed build, retry only when forced or once the index has doubled.
            if live >= self.cagra_min_vectors and (force or self._failed_at is None or live >= 2 * self._failed_at):
                self._rebuild()
            elif self._too_many_dead():
                self._space.compact()  # no graph to rebuild, but deleted rows must not pile up
            return
        if live < self.cagra_min_vectors // 2:  # shrank far below the threshold: back to exact only
            self._drop_graph()
            return
        if self._too_many_dead():
            self._rebuild()
        elif self.pending_rows >= self.extend_min_vectors or (force and self.pending_rows > 0):
            self._extend()

    def _drop_graph(self) -> None:
        self._index = None
        self._graph_dataset = None
        self._n_graph = 0
        self._bitsets.clear()
        self._alive_bitset = None

    def _rebuild(self) -> None:
        self._space.compact()
        self._drop_graph()
        n = self._space.n
        if n < self.cagra_min_vectors:
            return
        dataset = self._space.vectors[:n]
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
        n_old, n_new = self._n_graph, self._space.n
        full = self._space.vectors[:n_new]
        params = self.cagra.ExtendParams()
        t0 = time.perf_counter()
        try:
            self._sync()
            with self._on_device():
                out, self._extend_style = call_extend(self.cagra, params, self._index, full, n_old, n_new, self._extend_style)
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

    # -- queries
    def route(self, user_id: str, k: int) -> Literal["exact", "cagra"]:
        """Which path a search for this user and k takes (see the module docstring)."""
        n = self._exact.count(user_id)
        if self._index is None or n <= self.exact_user_max_vectors or k >= n:
            return "exact"
        return "cagra"

    def search(self, user_id: str, query: Any, k: int, *, route: Literal["exact", "cagra"] | None = None) -> list[list[SearchHit]]:
        """User-filtered top-k; `route` forces a path (benchmarks), None applies the rule."""
        q = as_matrix(query, self.dim, self.device, self.normalize)
        with self._lock:
            n = self._exact.count(user_id)
            if n == 0 or k <= 0:
                return [[] for _ in range(q.shape[0])]
            path = route or self.route(user_id, k)
            if path == "exact" or self._index is None:
                return self._exact.search_normalized(user_id, q, k)
            space = self._space
            code = space.user_code[user_id]
            bitset = self._bitsets.get(code)
            if bitset is None:
                bitset = self._bitsets[code] = self._upload_bits(space.user_mask(code, 0, self._n_graph))
            pend = np.flatnonzero(space.user_mask(code, self._n_graph, space.n)) + self._n_graph
            return self._graph_search(q, min(int(k), n), bitset, pend, allowed_user=code)

    def search_all(self, query: Any, k: int, *, route: Literal["exact", "cagra"] | None = None) -> list[list[SearchHit]]:
        """Unfiltered top-k over every user's live facts (benchmarks and diagnostics)."""
        q = as_matrix(query, self.dim, self.device, self.normalize)
        with self._lock:
            live = len(self._exact)
            if live == 0 or k <= 0:
                return [[] for _ in range(q.shape[0])]
            kk = min(int(k), live)
            space = self._space
            if route == "exact" or self._index is None:
                if space.n_dead == 0:
                    top, rows = torch.topk(q @ space.vectors[: space.n].T, kk, dim=1)
                else:
                    alive = torch.from_numpy(np.flatnonzero(space.alive[: space.n])).to(self.device)
                    top, cols = torch.topk(q @ space.vectors[alive].T, kk, dim=1)
                    rows = alive[cols]
                return to_hits(top, rows, space.fact.__getitem__)
            bitset = None
            if space.n_dead:
                if self._alive_bitset is None:
                    self._alive_bitset = self._upload_bits(space.alive[: self._n_graph])
                bitset = self._alive_bitset
            pend = np.flatnonzero(space.alive[self._n_graph : space.n]) + self._n_graph
            return self._graph_search(q, kk, bitset, pend, allowed_user=None)

    def _upload_bits(self, mask: np.ndarray) -> Any:
        words = pack_bits(mask)
        return U32Words(torch.from_numpy(words.view(np.int32).copy()).to(self.device))

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
        return to_numpy(d), to_numpy(nb).astype(np.int64, copy=False)

    def _graph_search(self, q: torch.Tensor, k: int, bitset: Any, pend: np.ndarray, allowed_user: int | None) -> list[list[SearchHit]]:
        space = self._space
        nq = q.shape[0]
        kg = min(k, self._n_graph)
        _, nb = self.raw_search(q, kg, bitset)
        # Drop what the graph may return past the allowed set (invalid ids when fewer than k pass).
        valid = (nb >= 0) & (nb < self._n_graph)
        safe = np.where(valid, nb, 0)
        valid &= space.alive[safe]
        if allowed_user is not None:
            valid &= space.user[safe] == allowed_user
        cand = np.concatenate([safe, np.broadcast_to(pend, (nq, pend.size))], axis=1)
        ok = np.concatenate([valid, np.ones((nq, pend.size), dtype=np.bool_)], axis=1)
        # Re-score candidates exactly (cosine) and keep the best k.
        cand_t = torch.from_numpy(np.ascontiguousarray(cand)).to(self.device)
        ok_t = torch.from_numpy(np.ascontiguousarray(ok)).to(self.device)
        scores = torch.einsum("qmd,qd->qm", space.vectors[cand_t], q)
        scores = scores.masked_fill(~ok_t, float("-inf"))
        top, pos = torch.topk(scores, min(k, cand.shape[1]), dim=1)
        rows = torch.gather(cand_t, 1, pos)
        top_l, rows_l = top.cpu().tolist(), rows.cpu().tolist()
        out: list[list[SearchHit]] = []
        row_fact = space.fact
        for sr, rr in zip(top_l, rows_l):
            hits: list[SearchHit] = []
            seen: set[int] = set()
            for s, r in zip(sr, rr):
                if s == float("-inf") or r in seen:
                    continue
                seen.add(r)
                hits.append(SearchHit(row_fact[r], float(s)))  # type: ignore[arg-type]
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
