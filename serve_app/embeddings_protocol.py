"""HTTP models of OpenAI's embeddings route (POST /v1/embeddings): the memory's query embedder
(memory.embedder) on a string or a list of strings, as floats or base64.

Bounded here in characters and counts (the ingress cannot tokenize); the replica bounds tokens (an
input longer than the model reads is refused, never silently cut: serve_app.replica.query_embeddings).
Token-id inputs (OpenAI's tiktoken ids, which LangChain's OpenAIEmbeddings sends unless told
`check_embedding_ctx_length=False`) mean nothing to this model's tokenizer and are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from serve_app.api_settings import MAX_EMBEDDING_INPUTS
from serve_app.protocol import MAX_ID_CHARS, MAX_MESSAGE_CHARS, MAX_REQUEST_CHARS

EmbeddingText = Annotated[str, Field(min_length=1, max_length=MAX_MESSAGE_CHARS)]


def _text_only(value: Any) -> Any:
    """Token-id inputs refused with a message that says so (the union's own errors would not)."""
    items = value if isinstance(value, list) else [value]
    if any(type(item) is int or (isinstance(item, list) and item and all(type(i) is int for i in item)) for item in items):
        raise ValueError(
            "input as token ids is not supported: this embedding model has its own tokenizer; send the text "
            "(LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)"
        )
    return value


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request; anything else is refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: Annotated[
        EmbeddingText | Annotated[list[EmbeddingText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)],
        BeforeValidator(_text_only),
    ] = Field(..., description="A string or a list of strings (at most embeddings.max_inputs), each within the model's token limit.")
    model: str | None = Field(None, max_length=MAX_ID_CHARS, description="The embedding model's name (GET /v1/models); others get 404.")
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description="float (the default), or base64 of little-endian float32 (what the openai client asks for)."
    )
    dimensions: int | None = Field(
        None, ge=1, le=65_536, description="Only the model's own dimension: this model cannot shorten its embeddings (400 otherwise)."
    )
    user: str | None = Field(
        None, min_length=1, max_length=MAX_ID_CHARS, description="A user the key must be allowed to act for; the request counts against that user's rates."
    )

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)

    @field_validator("input")
    @classmethod
    def _bounded_total(cls, value: str | list[str]) -> str | list[str]:
        total = len(value) if isinstance(value, str) else sum(len(text) for text in value)
        if total > MAX_REQUEST_CHARS:
            raise ValueError(f"input holds {total} characters; at most {MAX_REQUEST_CHARS} per request")
        return value


class EmbedderBusy(RuntimeError):
    """The replica's embedder did not answer within embeddings.timeout_s: 503 with Retry-After
    (serve_app.ingress.errors.http_error)."""


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(..., description="Floats, or base64 of little-endian float32 (encoding_format).")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = Field(..., description="Tokens the embedding model read, by its own tokenizer (special tokens included).")
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
