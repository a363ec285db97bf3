"""HTTP models of OpenAI's text completions (POST /v1/completions): a prompt continued as it is,
with no chat template and no memory (memory conditions chats: serve_app.protocol).

Bounded like chats (characters here, tokens in the replica); a prompt is text or the model's token ids
(checked against the vocabulary by the replica); fields of OpenAI's API this service
does not implement (echo, suffix, best_of, logit_bias, logprobs) are refused by name (400).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from serve_app.protocol import (
    INT64, MAX_CHOICES, MAX_ID_CHARS, MAX_REQUEST_CHARS, MAX_STOP_CHARS, MAX_STOP_SEQUENCES, MAX_TOKENS_FIELD, StreamOptions, Usage,
)

Prompt = Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_CHARS)]
MAX_PROMPT_TOKEN_IDS = 131_072  # a sanity bound; the replica checks the ids against the vocabulary and the context
TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]


def _one_prompt(value: Any) -> Any:
    """OpenAI's prompt forms, with a message that says which one was meant: a string, token ids, or a
    list of several prompts (one per request here), instead of the union's error for each member."""
    if not isinstance(value, list) or not value:
        return value
    if len(value) > 1 and not all(type(item) is int for item in value):
        raise ValueError(f"one prompt per request here (this list holds {len(value)}); send each prompt in its own request")
    if len(value) == 1 and isinstance(value[0], list):
        return value[0]  # [[ids]]: one prompt of token ids
    return value


class CompletionRequest(BaseModel):
    """The part of OpenAI's completions request this service implements; anything else is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Annotated[Prompt | Annotated[list[Prompt], Field(min_length=1, max_length=1)] | TokenIds, BeforeValidator(_one_prompt)] = Field(
        ...,
        description="The text to continue: a string, a list holding one, or the model's token ids (a list of ints, or a "
        "list holding one such list); one prompt per request.",
    )
    model: str | None = Field(None, max_length=MAX_ID_CHARS, description="The served model's name (GET /v1/models); others get 404.")
    user: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS, description="Scopes the prefix cache to this user.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_FIELD, description="Most tokens to generate per choice.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 (the default here) is greedy.")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description=f"Choices (at most {MAX_CHOICES}).")
    seed: int | None = Field(None, ge=-INT64 - 1, le=INT64)
    stop: (
        Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
        | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP_SEQUENCES)]
        | None
    ) = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool | None = Field(False, description="Stream server-sent events of text_completion objects.")
    stream_options: StreamOptions | None = Field(None, description="Only with stream=true.")

    @property
    def text(self) -> str:
        """The prompt's text ("" for a prompt of token ids)."""
        if isinstance(self.prompt, str):
            return self.prompt
        return self.prompt[0] if isinstance(self.prompt[0], str) else ""

    @property
    def token_ids(self) -> list[int] | None:
        """The prompt's token ids when it was given as ids, else None."""
        return self.prompt if isinstance(self.prompt, list) and isinstance(self.prompt[0], int) else None  # type: ignore[return-value]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """The answer, or (with stream=true) one server-sent event of it: text deltas per choice."""

    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
