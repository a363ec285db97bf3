"""HTTP request/response models: OpenAI chat completions, plus Mem0-style memory operations."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class MemoryOptions(BaseModel):
    """How a chat request uses the user's memory (an extension field of the request body)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["kv", "prompt", "none"] = Field(
        "kv", description="kv: inject the facts' stored KV; prompt: prefill the same facts as text; none: no memory."
    )
    top_k: int | None = Field(None, ge=0, le=200, description="Facts to retrieve; default from the service settings.")


class ChatCompletionRequest(BaseModel):
    """The subset of OpenAI's chat-completions request this service honours."""

    model_config = ConfigDict(extra="ignore")

    messages: list[ChatMessage] = Field(..., min_length=1, description="Conversation so far, oldest first.")
    model: str | None = Field(None, description="Ignored beyond a sanity check; one model is served.")
    user: str | None = Field(None, min_length=1, max_length=256, description="User id: whose memory to use.")
    max_tokens: int | None = Field(None, gt=0, description="Most tokens to generate.")
    temperature: float = Field(0.0, ge=0, le=2, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stream: bool = Field(False, description="Stream server-sent events of chat.completion.chunk objects.")
    memory: MemoryOptions = Field(
        default_factory=MemoryOptions, description="Memory use; applies when `user` is set."
    )


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    finish_reason: str | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class MemoryUsage(BaseModel):
    """What memory a chat answer was conditioned on."""

    mode: str
    fact_ids: list[str] = Field(default_factory=list, description="Retrieved facts, most relevant first.")
    injected_tokens: int = Field(0, description="Prompt tokens whose KV the connector was asked to supply.")
    cached_tokens: int = Field(0, description="Prompt tokens the engine did not prefill (injected or prefix-cached).")


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    memory: MemoryUsage | None = None


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (the last one carries usage and memory)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    memory: MemoryUsage | None = None


class TurnIn(BaseModel):
    """A conversation turn given with facts (its id is what facts' source_id refers to)."""

    model_config = ConfigDict(extra="forbid")

    turn_id: str = Field(..., min_length=1, max_length=128)
    speaker: str = Field(..., min_length=1, max_length=128)
    text: str = Field(..., max_length=20000)
    session_time: str | None = None


class AddMemoryRequest(BaseModel):
    """Mem0 `add`: messages (facts extracted by the served model) or facts given directly."""

    model_config = ConfigDict(extra="forbid")

    user_id: str = Field(..., min_length=1, max_length=256)
    messages: list[ChatMessage] | None = Field(None, description="Conversation turns to extract facts from (infer=true).")
    facts: list[str] | None = Field(None, description="Facts stored as given (source: the last turn, if any).")
    turns: list[TurnIn] | None = Field(None, description="Turns to record before the facts (their context window).")
    source_id: str | None = Field(None, description="Turn id the given facts come from.")
    infer: bool = Field(True, description="Extract facts from `messages` with the served model.")

    @model_validator(mode="after")
    def _something_to_add(self) -> "AddMemoryRequest":
        if not self.messages and not self.facts and not self.turns:
            raise ValueError("give messages, facts or turns")
        return self


class SearchMemoryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: str = Field(..., min_length=1, max_length=256)
    query: str = Field(..., min_length=1, max_length=20000)
    limit: int = Field(10, gt=0, le=200)


class UpdateMemoryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(..., min_length=1, max_length=2000)


class RequestRejected(ValueError):
    """A request the service refuses (bad input); maps to HTTP 400 and leaves all state untouched."""


class NotFound(KeyError):
    """An unknown fact (or a fact of another user); maps to HTTP 404."""
