"""Query embeddings: Embedder.embed_query (CUDA graphs on a GPU, memory.query_graphs) against
the batch path sentence-transformers' encode takes."""

from __future__ import annotations

import numpy as np


def test_a_query_embeds_as_the_batch_path_does_and_the_graphed_forward_is_the_same_math() -> None:
    """embed_query (CUDA graphs on a GPU, memory.query_graphs) gives encode's row: here the eager
    fallback, and the forward the graphs capture (mean pooling, normalise) computed eagerly."""
    import torch

    from memory.embedder import Embedder
    from memory.query_graphs import QueryGraphs

    embedder = Embedder(device="cpu")
    assert embedder.query_graphs() is None  # graphs only on CUDA devices
    for query in ("What is my cat called?", "Where did Caroline move from four years ago, and why?"):
        row = embedder.embed([query])[0]
        np.testing.assert_array_equal(embedder.embed_query(query), row)
        ids = embedder._model.tokenizer(query, truncation=True, max_length=256)["input_ids"]
        graphed = QueryGraphs.__new__(QueryGraphs)
        graphed.model = embedder._model[0].auto_model
        with torch.inference_mode():
            np.testing.assert_allclose(graphed._forward(torch.tensor([ids])).numpy(), row, atol=1e-6)


def test_query_ids_are_the_tokenizers_own_also_past_the_models_length() -> None:
    """Embedder.query_ids (the Rust backend, called directly) gives what the tokenizer's own call
    with the model's truncation gives, for short queries and one longer than max_seq_length."""
    from memory.embedder import Embedder

    embedder = Embedder(device="cpu")
    tokenizer, limit = embedder._model.tokenizer, embedder._model.max_seq_length
    long_query = " ".join(f"word{i}" for i in range(2 * limit))
    for query in ("What is my cat called?", "Caf\u00e9 na\u00efve \u2014 \U0001f600?", long_query):
        expected = tokenizer(query, truncation=True, max_length=limit)["input_ids"]
        assert embedder.query_ids(query) == expected
    assert len(embedder.query_ids(long_query)) == limit
