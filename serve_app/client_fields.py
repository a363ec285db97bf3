"""The request fields OpenAI clients and agent frameworks send on every call that change nothing here:
accepted (bounded, typed as OpenAI types them) and ignored, on chats and on the Responses API.

- `store`: OpenAI keeps the chat completion for its dashboard; this service keeps no chat completions
  (a Responses request's `store` does decide whether its response is kept: serve_app.responses_protocol);
- `metadata`: tags for OpenAI's dashboard (at most 16 string pairs, as OpenAI bounds them);
- `service_tier`: OpenAI's processing tier; here every request has the same one (the priority
  between chats and memory encodes is the service's: serve_app.replica.scheduling);
- `safety_identifier`: an end user's id for OpenAI's abuse detection (never the memory's `user`);
- `prompt_cache_key`: OpenAI's routing hint for its prefix cache; vLLM's prefix cache here is
  automatic and scoped by user or key (memory.composition), so the hint has nothing to add.

Every other field OpenAI defines and this service does not implement stays refused by name (400).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_METADATA_PAIRS = 16  # OpenAI's bounds on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_HINT_CHARS = 256

MetadataKey = Annotated[str, Field(min_length=1, max_length=MAX_METADATA_KEY_CHARS)]
MetadataValue = Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class IgnoredClientFields(BaseModel):
    """The fields of the module docstring, for a request model to inherit."""

    model_config = ConfigDict(extra="forbid", strict=True)

    store: bool | None = Field(None, description="Accepted and ignored on chats: this service keeps no chat completions.")
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_PAIRS)] | None = Field(
        None, description="Accepted and ignored (OpenAI's dashboard tags: at most 16 string pairs)."
    )
    service_tier: ServiceTier | None = Field(None, description="Accepted and ignored: every request has the same tier here.")
    safety_identifier: str | None = Field(None, max_length=MAX_HINT_CHARS, description="Accepted and ignored (OpenAI's abuse detection).")
    prompt_cache_key: str | None = Field(
        None, max_length=MAX_HINT_CHARS, description="Accepted and ignored: the prefix cache is automatic, scoped by user or key."
    )
