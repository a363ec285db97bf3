"""HTTP request/response models (OpenAI chat-completions shape)."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


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
    stream: bool = Field(False, description="Streaming is not served yet; true is rejected with 400.")


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    finish_reason: str | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class RequestRejected(ValueError):
    """A request the service refuses (bad input); maps to HTTP 400 and leaves all state untouched."""
