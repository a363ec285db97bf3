"""QueryEmbeddings: POST /v1/embeddings on the LLM replica, with the memory's own query embedder.

The model is the memory shard's (memory.embedder.Embedder on `memory.embedding_model`: the same
weights, tokenizer and unit-norm rows that chats are retrieved with), but a copy loaded in the
replica (`embeddings.device`, the CPU by default), not a call to the shard: the shard runs one call
at a time under its lock, and a client's batch of texts would hold every chat's plan behind it.
The copy is loaded on a thread when the replica starts, so the first request does not pay for it.

Each request is bounded before it runs: at most `embeddings.max_inputs` texts, each within the
tokens the model reads (a longer one is refused, naming it, not silently cut as encode() would),
at most `embeddings.max_request_tokens` in all; requests run one at a time per replica on one
worker thread, each waiting at most `embeddings.timeout_s` (503 past it; a request whose caller
gave up before its turn is never run). QueryEmbeddings is held by MemoryLLM (serve_app.replica.server),
which makes it at the replica's start and answers Serve's `embed` calls through it.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import logging
import time
from typing import Any, Callable

import numpy as np

from memory.embedder import Embedder
from serve_app.embeddings_protocol import EmbedderBusy, Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from serve_app.protocol import NotFound, RequestRejected
from serve_app.settings import ServiceSettings

logger = logging.getLogger(__name__)


def encoded(row: np.ndarray, encoding_format: str | None) -> list[float] | str:
    """A row as OpenAI sends it: floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(row, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in row]


class QueryEmbeddings:
    """embed() with a replica-local copy of the query embedder (module docstring)."""

    def __init__(self, settings: ServiceSettings) -> None:
        """Starts loading the embedder on the worker thread that will run it (made at the replica's start)."""
        self.settings = settings
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="embeddings")
        self._embedder: concurrent.futures.Future[Embedder] = self._worker.submit(self._load_embedder)

    def _load_embedder(self) -> Embedder:
        started = time.perf_counter()
        embedder = Embedder(self.settings.memory.embedding_model, device=self.settings.embeddings.device)
        embedder.embed(["warm up"])  # the first encode's own one-time costs, here rather than in a request
        logger.info("embeddings: %s loaded on %s in %.1f s", self.settings.embedding_model_name,
                    self.settings.embeddings.device, time.perf_counter() - started)
        return embedder

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """The request's embeddings, or RequestRejected / NotFound before anything runs, or EmbedderBusy."""
        name = self.settings.embedding_model_name
        if request.model is not None and request.model != name:
            raise NotFound(f"the model {request.model!r} does not exist; this service embeds with {name!r}", param="model", code="model_not_found")
        limits = self.settings.embeddings
        texts = request.texts
        if len(texts) > limits.max_inputs:
            raise RequestRejected(f"input holds {len(texts)} texts; at most {limits.max_inputs} per request (embeddings.max_inputs)", param="input")
        deadline = time.monotonic() + limits.timeout_s
        embedder = await self._in_time(asyncio.wrap_future(self._embedder), deadline)
        if request.dimensions is not None and request.dimensions != embedder.dim:
            raise RequestRejected(
                f"dimensions={request.dimensions}: {name} gives {embedder.dim}-dimensional embeddings and cannot shorten them "
                f"(it is not trained for truncated embeddings); leave dimensions out, or give {embedder.dim}",
                param="dimensions", code="unsupported_value",
            )
        counts = await self._on_worker(lambda: embedder.token_counts(texts), deadline)
        self._check_tokens(counts, embedder.max_tokens, isinstance(request.input, list))
        rows = await self._on_worker(lambda: embedder.embed(texts), deadline)
        return EmbeddingResponse(
            data=[Embedding(index=i, embedding=encoded(row, request.encoding_format)) for i, row in enumerate(rows)],
            model=name,
            usage=EmbeddingUsage(prompt_tokens=sum(counts), total_tokens=sum(counts)),
        )

    def _check_tokens(self, counts: list[int], per_text: int, listed: bool) -> None:
        for i, count in enumerate(counts):
            if count > per_text:
                param = f"input.{i}" if listed else "input"
                raise RequestRejected(
                    f"{param} is {count} tokens long; {self.settings.embedding_model_name} reads at most {per_text} (it would "
                    "embed only their start): split the text", param=param, code="context_length_exceeded",
                )
        limit = self.settings.embeddings.max_request_tokens
        if sum(counts) > limit:
            raise RequestRejected(
                f"input holds {sum(counts)} tokens in all; at most {limit} per request (embeddings.max_request_tokens): "
                "send fewer texts per request", param="input", code="request_too_large",
            )

    async def _on_worker(self, work: Callable[[], Any], deadline: float) -> Any:
        """`work()` on the embedder's thread, after the requests before it; never run once its caller gave up."""
        return await self._in_time(asyncio.wrap_future(self._worker.submit(work)), deadline)

    @staticmethod
    async def _in_time(waited: "asyncio.Future[Any]", deadline: float) -> Any:
        try:
            return await asyncio.wait_for(waited, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:  # the wrapped future's cancel reaches a job still queued: it never runs
            raise EmbedderBusy("the embedder gave no answer within embeddings.timeout_s (busy, or still loading)") from None
