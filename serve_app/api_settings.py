"""Settings of the OpenAI routes beyond chat: embeddings (POST /v1/embeddings) and the Responses API's
stored responses (POST /v1/responses with `previous_response_id`). Read by serve_app.settings (the
application's `args`: `embeddings`, `responses`); imports no implementation.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"  # memory.embedder's default model, as the API names it
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound; `embeddings.max_inputs` may only lower it


class EmbeddingsSettings(BaseModel):
    """POST /v1/embeddings: the memory's query embedder (memory.embedder, `memory.embedding_model`),
    loaded in each LLM replica at its start and run there, one request at a time per replica."""

    model_config = ConfigDict(extra="forbid")

    served_name: str = Field(
        "",
        max_length=256,
        description="The embedding model's name in the API (`model`, GET /v1/models); empty: all-MiniLM-L6-v2 for the "
        "default model, else the folder name of memory.embedding_model.",
    )
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description="Where the replica runs its copy of the embedder. cpu (the default) keeps it off the GPU's memory plan; "
        "the memory shard's own copy (memory.embedding_device) serves chats and adds.",
    )
    max_inputs: int = Field(
        128, ge=1, le=MAX_EMBEDDING_INPUTS, description="Most strings one request may embed (400 past it, naming `input`)."
    )
    max_request_tokens: int = Field(
        8192,
        ge=1,
        description="Most tokens (by the embedder's tokenizer) one request may embed in all (400 past it): the work of one "
        "request is bounded.",
    )
    timeout_s: float = Field(
        30.0, gt=0, description="Most seconds a request waits for the replica's embedder (its load at start, its turn, its run): 503 past it."
    )


class ResponsesSettings(BaseModel):
    """What the Responses API keeps so that `previous_response_id` can continue a conversation: each
    stored response's conversation (input and output, not its instructions) in Redis, readable by
    the API key that made it, for `store_ttl_s`, at most `max_stored_per_key` per key (the oldest
    dropped first); a user's stored responses are erased with the user's memory."""

    model_config = ConfigDict(extra="forbid")

    store_ttl_s: int = Field(3600, ge=60, le=30 * 86400, description="Seconds a stored response stays continuable and retrievable.")
    max_stored_per_key: int = Field(
        1000, ge=1, le=100_000, description="Stored responses kept per API key; a new one past it drops the key's oldest."
    )


def embedding_model_name(settings: EmbeddingsSettings, embedding_model: str | None) -> str:
    """The API's name of the embedding model (`served_name`, else from memory.embedding_model's folder)."""
    if settings.served_name:
        return settings.served_name
    return Path(embedding_model.rstrip("/")).name if embedding_model else DEFAULT_EMBEDDING_NAME
