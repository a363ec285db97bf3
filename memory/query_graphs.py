"""One query's embedding on a CUDA device, replayed from a CUDA graph per token count.

Eager PyTorch dispatches all-MiniLM-L6-v2's few hundred small kernels one by one from Python:
the shard's `shard_embed` stage took many times the forward's own GPU work on a GPU host
(docs/measured.md).
A single query needs no padding, so each token count n has one static graph: [1, n] token ids
in, the mean-pooled, L2-normalised row out (the model's own Pooling + Normalize modules, which
sentence-transformers applies in `encode`). Graphs are captured lazily (one per n seen, sharing
one memory pool) and `warm_up` captures the common lengths at start. Anything that fails to
capture turns the graphs off and the caller falls back to the eager path: never a wrong row.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class QueryGraphs:
    """CUDA graphs of `model` (a transformers encoder) for single queries, keyed by token count."""

    def __init__(self, model: Any, device: torch.device | str) -> None:
        self.model = model.eval()
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.disabled_because: str | None = None

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=ids, token_type_ids=torch.zeros_like(ids)).last_hidden_state
        return torch.nn.functional.normalize(hidden.mean(dim=1), dim=-1)[0]

    def _capture(self, n: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        ids = torch.zeros(1, n, dtype=torch.long, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):  # lazy initialisations happen outside the graph
                self._forward(ids)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
            row = self._forward(ids)
        self.graphs[n] = (graph, ids, row)
        return self.graphs[n]

    def embed(self, token_ids: list[int]) -> torch.Tensor | None:
        """The query's normalised row (float32, on the host), or None when graphs are off."""
        row = self.launch(token_ids)
        return None if row is None else row.float().cpu()

    def launch(self, token_ids: list[int]) -> torch.Tensor | None:
        """Replay the graph for these ids without waiting: the returned device tensor holds the
        row once the stream gets there (read it before the next launch). None when graphs are off."""
        if self.disabled_because is not None:
            return None
        try:
            graph, ids, row = self.graphs.get(len(token_ids)) or self._capture(len(token_ids))
            ids.copy_(torch.tensor(token_ids, dtype=torch.long).view(1, -1), non_blocking=False)
            graph.replay()
            return row
        except Exception as exc:  # noqa: BLE001 - an encoder whose forward cannot be captured: eager from now on
            self.disabled_because = f"{type(exc).__name__}: {exc}"[:300]
            logger.warning("query embeddings fall back to eager: %s", self.disabled_because)
            self.graphs.clear()
            return None

    def warm_up(self, lengths: range) -> None:
        for n in lengths:
            if self.embed([0] * n) is None:
                return
