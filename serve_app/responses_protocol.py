"""HTTP models of OpenAI's Responses API (POST /v1/responses) and its translation into a chat.

A Responses request is a chat in another dialect: `input` (a string, or message items whose content
is text), `instructions` (a system message, not carried over to the next response, as OpenAI does),
`max_output_tokens`, sampling, `text.format` (structured output), `user` and `memory` (the memory
semantics of chats: serve_app.protocol), and `previous_response_id`, which puts the stored
conversation of that response in front (memory.response_store). `as_chat` builds the
ChatCompletionRequest the replica runs; the answer comes back as a `response` object whose output
is one assistant message. Fields of OpenAI's API that this service does not implement (tools,
reasoning, include, background, conversation, ...) are refused by name (400), never ignored; the
harmless ones clients always send are accepted (serve_app.client_fields).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.client_fields import IgnoredClientFields
from serve_app.protocol import (
    MAX_CHAT_MESSAGES, MAX_CONTENT_PARTS, MAX_ID_CHARS, MAX_MESSAGE_CHARS, MAX_REQUEST_CHARS, MAX_TOKENS_FIELD,
    ChatCompletionRequest, JsonSchemaFormat, MemoryOptions, MemoryUsage, RequestRejected, ResponseFormat,
)

RESPONSE_ID_PATTERN = r"^resp_[0-9a-f]{32}$"


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


class InputText(BaseModel):
    """A text part of an input message: input_text (user, system), or output_text (an earlier answer
    given back; its annotations and logprobs are accepted and ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["input_text", "output_text"]
    text: str = Field(..., max_length=MAX_MESSAGE_CHARS)
    annotations: Annotated[list[dict[str, Any]], Field(max_length=64)] | None = None
    logprobs: Annotated[list[dict[str, Any]], Field(max_length=4096)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("type"), str) and data["type"] not in ("input_text", "output_text"):
            raise ValueError(f"content parts of type {data['type']!r} are not supported: this service reads text only")
        return data


class InputMessageItem(BaseModel):
    """A message item of `input` (OpenAI's EasyInputMessage, or an output message given back)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["message"] | None = Field(None, description="Only message items: tool calls, reasoning and item references are not supported.")
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)] | Annotated[list[InputText], Field(min_length=1, max_length=MAX_CONTENT_PARTS)]
    id: str | None = Field(None, max_length=MAX_ID_CHARS, description="An output message's id, given back: ignored.")
    status: Literal["in_progress", "completed", "incomplete"] | None = Field(None, description="An output message's status, given back: ignored.")

    @model_validator(mode="before")
    @classmethod
    def _messages_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("type"), str) and data["type"] != "message":
            raise ValueError(f"input items of type {data['type']!r} are not supported: only messages (this service calls no tools)")
        return data

    def as_prompt_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object"]


class JsonSchemaTextFormat(JsonSchemaFormat):
    """text.format of type json_schema: the schema's fields flat beside `type`, as the Responses API has them."""

    type: Literal["json_schema"]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: JsonObjectFormat | JsonSchemaTextFormat | None = Field(None, description="text, json_object, or json_schema (structured output).")


class ResponsesRequest(IgnoredClientFields):
    """The part of OpenAI's Responses request this service implements (module docstring)."""

    input: Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_CHARS)] | Annotated[
        list[InputMessageItem], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    ] = Field(..., description="A string (one user message) or message items, oldest first.")
    model: str | None = Field(None, max_length=MAX_ID_CHARS, description="The served model's name (GET /v1/models); others get 404.")
    instructions: str | None = Field(None, max_length=MAX_MESSAGE_CHARS, description="A system message first; not carried over by previous_response_id.")
    previous_response_id: str | None = Field(
        None, pattern=RESPONSE_ID_PATTERN, description="Continue a stored response of this key (its conversation comes first)."
    )
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_FIELD, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 (the default here) is greedy.")
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = None
    stream: bool | None = Field(False, description="Stream the Responses API's server-sent events.")
    truncation: Literal["disabled"] | None = Field(None, description="Only disabled: a conversation past the context is a 400.")
    user: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS, description="User id: whose memory to use (as for chats).")
    memory: MemoryOptions = Field(default_factory=MemoryOptions, description="Memory use; applies when `user` is set.")
    store: bool | None = Field(
        None, description="Keep the response (the default, as OpenAI's) so previous_response_id and GET /v1/responses/{id} reach it (settings `responses`)."
    )

    @property
    def stored(self) -> bool:
        return self.store is not False

    def input_messages(self) -> list[dict[str, str]]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [item.as_prompt_dict() for item in self.input]

    def response_format(self) -> ResponseFormat | None:
        chosen = self.text.format if self.text is not None else None
        if chosen is None or chosen.type == "text":
            return None
        if isinstance(chosen, JsonSchemaTextFormat):
            schema = JsonSchemaFormat.model_validate(chosen.model_dump(exclude={"type"}, by_alias=True))
            return ResponseFormat(type="json_schema", json_schema=schema)
        return ResponseFormat(type="json_object")

    def as_chat(self, history: list[dict[str, str]]) -> ChatCompletionRequest:
        """The chat this request is: [instructions][history][input] (RequestRejected naming the field at
        fault when the stored conversation and this input together pass a chat's bounds)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + history + self.input_messages()
        at_fault = "previous_response_id" if history else "input"
        if len(messages) > MAX_CHAT_MESSAGES:
            raise RequestRejected(f"the conversation would hold {len(messages)} messages; at most {MAX_CHAT_MESSAGES}", param=at_fault)
        if (total := sum(len(m["content"]) for m in messages)) > MAX_REQUEST_CHARS:
            raise RequestRejected(f"the conversation would hold {total} characters; at most {MAX_REQUEST_CHARS}", param=at_fault)
        return ChatCompletionRequest.model_validate({
            "messages": messages, "model": self.model, "user": self.user, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": bool(self.stream), "memory": self.memory,
            "response_format": self.response_format(),
        }, strict=False)


# ---------------------------------------------------------------------------------------------- answers
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str = Field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """OpenAI's `response` object (the fields this service fills), with this service's memory report."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputMessage] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = False
    tool_choice: Literal["none"] = "none"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    usage: ResponseUsage | None = None
    memory: MemoryUsage | None = None
    timings: dict[str, float] | None = None

    @classmethod
    def started(cls, response_id: str, request: ResponsesRequest, model: str) -> "ResponseObject":
        """The response as it begins (status in_progress, no output yet), echoing the request's settings."""
        text = request.text.model_dump(exclude_none=True, by_alias=True) if request.text and request.text.format else {"format": {"type": "text"}}
        return cls(
            id=response_id, status="in_progress", model=model, instructions=request.instructions,
            previous_response_id=request.previous_response_id, max_output_tokens=request.max_output_tokens,
            temperature=request.temperature, top_p=request.top_p, text=text, store=request.stored,
            metadata=request.metadata or {}, user=request.user,
        )

    def finished(self, text: str, finish_reason: str | None, usage: Any, memory: MemoryUsage | None, timings: dict[str, float] | None) -> "ResponseObject":
        """This response completed (or incomplete, when it stopped at max_output_tokens) with `text`;
        `usage` is a chat's (serve_app.protocol.Usage) or None."""
        incomplete = finish_reason == "length"
        status: Literal["completed", "incomplete"] = "incomplete" if incomplete else "completed"
        message = OutputMessage(status=status, content=[OutputText(text=text)])
        return self.model_copy(update={
            "status": status, "output": [message], "memory": memory, "timings": timings,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None,
            "usage": None if usage is None else ResponseUsage(
                input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0),
            ),
        })


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
