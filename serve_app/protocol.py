"""HTTP request/response models of the chat API (OpenAI chat completions) and the errors every
route answers with; the memory API's models are in serve_app.memory_protocol.

Everything a client sends is bounded here, in characters and counts (the ingress cannot
tokenize: it imports neither torch nor transformers). Token bounds (a fact must fit one arena
entry, a prompt plus its output the context) are checked by the replica, which answers 400
before anything is stored or generated. Fields of OpenAI's API that this service does not
implement are refused by name (400, `extra="forbid"`), never silently ignored; the few that clients
always send and that change nothing here are accepted and ignored (serve_app.client_fields).
Types are strict, as the JSON schema says (`"max_tokens": "5"` or `"stream": 1` is refused,
not coerced).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from memory.chat_query import ChatQuery, MemoryMode
from memory.prompting import MEMORY_MARKER
from serve_app.client_fields import IgnoredClientFields

# Bounds on what a client sends (characters and counts; the replica bounds tokens).
MAX_CHAT_MESSAGES = 256
MAX_MESSAGE_CHARS = 100_000  # per chat message; the context length bounds the whole prompt in tokens
MAX_REQUEST_CHARS = 400_000  # all text of one request: the replica tokenizes it all
MAX_CONTENT_PARTS = 64
MAX_ID_CHARS = 256
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_CHOICES = 8  # n: each choice costs a whole generation
MAX_SCHEMA_BYTES = 16_384  # response_format's JSON schema, compiled to a grammar by the engine
MAX_TOKENS_FIELD = 1_000_000  # a sanity bound; the replica checks against the context and the service limit
INT64 = 2**63 - 1
MAX_SCHEMA_DEPTH = 16  # response_format's JSON schema: levels of objects and arrays


def json_depth(value: Any) -> int:
    """Levels of dicts and lists in a parsed JSON value (a scalar: 0; `{}`: 1), counted without
    recursion (a value nested past Python's recursion limit must not crash the check)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, level = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        pending.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def bounded_depth(value: Any, limit: int, what: str) -> Any:
    """`value` itself, or ValueError naming `what` and the limit when it nests deeper than `limit`."""
    if (depth := json_depth(value)) > limit:
        raise ValueError(f"{what} nests {depth} levels of objects and arrays; at most {limit}")
    return value

NonBlank = Annotated[str, Field(min_length=1, pattern=r"\S")]


class TextPart(BaseModel):
    """One part of a message's content given as a list (OpenAI's text content part)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"] = Field(..., description="Only text parts: the served model reads text.")
    text: str = Field(..., max_length=MAX_MESSAGE_CHARS)

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("type"), str) and data["type"] != "text":
            raise ValueError(f"content parts of type {data['type']!r} are not supported: this service reads text only")
        return data


class InputMessage(BaseModel):
    """A chat message as OpenAI clients send it: content as a string or a list of text parts."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"] = Field(
        ..., description="`developer` is treated as `system`. Tool messages are not supported."
    )
    content: (
        Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)]
        | Annotated[list[TextPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS)]
    )
    name: str | None = Field(None, max_length=64, description="Accepted for compatibility; not used.")

    @property
    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM joins them)."""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    @model_validator(mode="after")
    def _bounded_text(self) -> "InputMessage":
        text = self.text
        if len(text) > MAX_MESSAGE_CHARS:
            raise ValueError(f"message content of {len(text)} characters exceeds {MAX_MESSAGE_CHARS}")
        if MEMORY_MARKER in text:
            raise ValueError("message content holds a character sequence reserved by the service")
        return self

    def as_prompt_dict(self) -> dict[str, str]:
        """{"role", "content"} as the chat template takes it."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text}


class MemoryOptions(BaseModel):
    """How a chat request uses the user's memory (an extension field of the request body)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    mode: MemoryMode = Field(
        "kv",
        description="kv: inject the facts' stored KV; prompt: prefill the same facts as text; none: no memory; full: "
        "every fact of the user as text, oldest first, no retrieval (a fixed prefix that vLLM's prefix cache reuses "
        "across the user's requests: the peer that retrieval is measured against; the oldest that fit the context).",
    )
    top_k: int | None = Field(None, ge=0, le=200, description="Facts to retrieve; default from the service settings.")
    prefill_top_m: int | None = Field(
        None,
        ge=0,
        le=200,
        description="Mode kv: prefill the m most relevant facts as text after the injected ones, so they attend to the "
        "other facts (the cross-fact repair); default memory.prefill_top_m.",
    )


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(None, max_length=2_000)
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="A JSON Schema the answer must follow.")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _bounded_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            bounded_depth(value, MAX_SCHEMA_DEPTH, "the JSON schema")  # first: json.dumps recurses
            try:
                size = len(json.dumps(value, allow_nan=False).encode())
            except ValueError as exc:
                raise ValueError("the JSON schema holds NaN or Infinity") from exc
            if size > MAX_SCHEMA_BYTES:
                raise ValueError(f"the JSON schema holds {size} bytes; at most {MAX_SCHEMA_BYTES}")
        return value


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = Field(
        None, description="Send a last chunk with empty `choices` and the usage (and memory report)."
    )


class ChatCompletionRequest(IgnoredClientFields):
    """The part of OpenAI's chat-completions request this service implements, plus the fields clients
    always send that change nothing here (serve_app.client_fields); anything else is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    messages: list[InputMessage] = Field(
        ..., min_length=1, max_length=MAX_CHAT_MESSAGES, description="Conversation so far, oldest first."
    )
    model: str | None = Field(None, max_length=MAX_ID_CHARS, description="The served model's name (GET /v1/models); others get 404.")
    user: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS, description="User id: whose memory to use.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_FIELD, description="Most tokens to generate (deprecated name).")
    max_completion_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS_FIELD, description="Most tokens to generate; wins over max_tokens."
    )
    temperature: float | None = Field(None, ge=0, le=2, description="0 (the default here) is greedy.")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-INT64 - 1, le=INT64)
    stop: (
        Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
        | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP_SEQUENCES)]
        | None
    ) = Field(None, description="Up to 4 sequences where generation stops (not included in the answer).")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logprobs: bool | None = Field(None, description="Return the log probability of each generated token.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="Most likely alternatives per token (needs logprobs=true)."
    )
    n: int | None = Field(
        None, ge=1, le=MAX_CHOICES,
        description=f"Choices per request (at most {MAX_CHOICES}), each sampled on its own at the request's temperature; at "
        "temperature 0 (the default here) the choices are the one greedy answer, generated once.",
    )
    response_format: ResponseFormat | None = Field(
        None, description="json_object: the answer is a JSON object; json_schema: it follows the schema (vLLM's structured outputs)."
    )
    stream: bool | None = Field(False, description="Stream server-sent events of chat.completion.chunk objects.")
    stream_options: StreamOptions | None = Field(None, description="Only with stream=true.")
    memory: MemoryOptions = Field(
        default_factory=MemoryOptions, description="Memory use; applies when `user` is set."
    )

    @model_validator(mode="after")
    def _consistent(self) -> "ChatCompletionRequest":
        total = sum(len(m.text) for m in self.messages)
        if total > MAX_REQUEST_CHARS:
            raise ValueError(f"messages hold {total} characters; at most {MAX_REQUEST_CHARS} per request")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens (as vLLM reads them), else None."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompt_messages(self) -> list[dict[str, str]]:
        return [m.as_prompt_dict() for m in self.messages]

    def memory_query(self, messages: list[dict[str, str]], max_prompt_tokens: int) -> ChatQuery | None:
        """What this chat asks of its user's memory (`messages`: prompt_messages()), or None when
        it names no user or asks for no memory."""
        if not self.user or self.memory.mode == "none":
            return None
        options = self.memory
        return ChatQuery(
            user_id=self.user,
            messages=messages,
            mode=options.mode,
            top_k=options.top_k,
            max_prompt_tokens=max_prompt_tokens,
            prefill_top_m=options.prefill_top_m,
        )


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    """OpenAI's `choices[].logprobs`: one entry per generated token."""

    content: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens the engine did not prefill (prefix-cached or injected).")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


TIMINGS_DESCRIPTION = (
    "Milliseconds per stage of this request before its first token, on the replica (serve_app.stage_timings: "
    "prepare, plan_call, shard_embed, shard_search, shard_compose, shard_hop, engine_ttft, replica_ttft). The "
    "ingress's own stages are in the Server-Timing header."
)


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
    timings: dict[str, float] | None = Field(None, description=TIMINGS_DESCRIPTION)


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion. The finishing chunk carries usage and
    memory; with stream_options.include_usage they come in one more chunk with empty `choices`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    memory: MemoryUsage | None = None
    timings: dict[str, float] | None = Field(None, description=TIMINGS_DESCRIPTION)


class ErrorBody(BaseModel):
    message: str
    type: str = Field(..., description="invalid_request_error, authentication_error, not_found_error, server_error, ...")
    param: str | None = Field(None, description="The request field at fault, dotted (messages.0.content).")
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx answer, in OpenAI's shape."""

    error: ErrorBody


class RequestRejected(ValueError):
    """A request the service refuses (bad input); maps to HTTP 400 and leaves all state untouched."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class NotFound(KeyError):
    """An unknown fact (or a fact of another user), or an unknown model; maps to HTTP 404."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class EngineUnavailable(RuntimeError):
    """The replica's engine is down (dead, or being restarted in place); maps to HTTP 503 with
    Retry-After. `replica_id` names the replica, so the ingress can pass a chat to another replica
    of the same shard (serve_app.ingress.replica_calls)."""

    def __init__(self, message: str, replica_id: str = "") -> None:
        super().__init__(message, replica_id)  # both in args: the exception pickles across Ray as it is
        self.replica_id = replica_id
