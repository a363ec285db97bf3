"""OpenAI chat answers from vLLM outputs: one ChatCompletionResponse, or a stream of
server-sent `chat.completion.chunk` events (serve_app.protocol), each with the memory report
and the request's stage timings (serve_app.stage_timings). No engine calls here."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from serve_app.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    MemoryUsage,
    PromptTokensDetails,
    ResponseMessage,
    Usage,
)
from serve_app.replica.sampling import choice_logprobs


def usage_of(prompt_tokens: int, completion_tokens: int, output: Any) -> Usage:
    """OpenAI usage, with the engine's prefix-cache (and injection) hits as cached_tokens."""
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens or 0),
    )


def memory_usage(plan: Any, output: Any) -> MemoryUsage | None:
    """What memory the answer was conditioned on (None for a request without a plan)."""
    if plan is None:
        return None
    return MemoryUsage(
        mode=plan.mode,
        fact_ids=[f.fact_id for f in plan.facts],
        injected_tokens=plan.injected_tokens,
        cached_tokens=output.num_cached_tokens or 0,
    )


def logprobs_of(request: ChatCompletionRequest, completion: Any, start: int, tokenizer: Any) -> ChoiceLogprobs | None:
    """OpenAI logprobs of the completion's tokens from `start` on, when the request asked."""
    return choice_logprobs(completion, start, request.top_logprobs or 0, tokenizer) if request.logprobs else None


class Choices:
    """The latest cumulative output of each choice. With n > 1 vLLM yields each choice's output on
    its own (a RequestOutput holds the one that advanced), so they are gathered by index. With
    `copies` > 1 (n greedy choices: serve_app.replica.sampling.choice_copies) the engine ran one
    choice, and it is given as choices 0..copies-1."""

    def __init__(self, copies: int = 1) -> None:
        self.latest: dict[int, Any] = {}
        self.copies = copies

    def update(self, output: Any) -> None:
        for completion in output.outputs:
            self.latest[completion.index] = completion

    def indices(self, completion: Any) -> range:
        """The answer's choice indices that this engine completion stands for."""
        return range(self.copies) if self.copies > 1 else range(completion.index, completion.index + 1)

    def ordered(self) -> list[Any]:
        ran = [self.latest[index] for index in sorted(self.latest)]
        return [dataclasses.replace(c, index=i) for c in ran for i in self.indices(c)] if self.copies > 1 else ran

    def generated_tokens(self) -> int:
        """Tokens of every choice of the answer (OpenAI's usage counts each choice, copies too)."""
        return self.engine_tokens() * self.copies

    def engine_tokens(self) -> int:
        """Tokens the engine generated."""
        return sum(len(c.token_ids) for c in self.latest.values())


def completion_response(
    request: ChatCompletionRequest, model: str, choices: Choices, final: Any, prompt_ids: list[int], plan: Any,
    timings: dict[str, float], tokenizer: Any,
) -> ChatCompletionResponse:
    """The non-streamed answer: one choice per completion (n), from the engine's outputs."""
    return ChatCompletionResponse(
        model=model,
        choices=[
            ChatChoice(
                index=completion.index,
                message=ResponseMessage(content=completion.text),
                logprobs=logprobs_of(request, completion, 0, tokenizer),
                finish_reason=completion.finish_reason,
            )
            for completion in choices.ordered()
        ],
        usage=usage_of(len(prompt_ids), choices.generated_tokens(), final),
        memory=memory_usage(plan, final),
        timings=timings,
    )


class ChunkStream:
    """Turns the engine's cumulative outputs of one request into server-sent events, one chunk per
    choice that advanced (with n > 1, each choice's chunks carry its index). The finishing chunk
    carries usage, the memory report and the timings, or, with stream_options.include_usage, one
    more chunk with empty `choices` does (as OpenAI sends it); then `data: [DONE]`."""

    def __init__(self, request: ChatCompletionRequest, model: str, tokenizer: Any, copies: int = 1) -> None:
        self.request = request
        self.model = model
        self.tokenizer = tokenizer
        self.chunk_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.include_usage = bool(request.stream_options and request.stream_options.include_usage)
        self.sent_text: dict[int, int] = {}  # per choice: characters and tokens sent so far
        self.sent_tokens: dict[int, int] = {}
        self.choices = Choices(copies)
        self.tail: ChatCompletionChunk | None = None

    def event(self, output: Any, prompt_ids: list[int], plan: Any, timings: dict[str, float]) -> str | None:
        """The event for the engine's latest output; None when it adds no text yet (a partial
        character, a possible stop string) and is neither a choice's first nor its last."""
        self.choices.update(output)
        chunk_choices = []
        for completion in output.outputs:
            index, first = completion.index, completion.index not in self.sent_text
            delta = completion.text[self.sent_text.get(index, 0) :]
            if not delta and completion.finish_reason is None and not first:
                continue
            logprobs = logprobs_of(self.request, completion, self.sent_tokens.get(index, 0), self.tokenizer)
            chunk_choices += [
                ChunkChoice(
                    index=choice,
                    delta=ChunkDelta(role="assistant" if first else None, content=delta or None),
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                )
                for choice in self.choices.indices(completion)
            ]
            self.sent_text[index], self.sent_tokens[index] = len(completion.text), len(completion.token_ids)
        if not chunk_choices and not output.finished:
            return None
        chunk = ChatCompletionChunk(id=self.chunk_id, model=self.model, choices=chunk_choices)
        if output.finished:
            usage = usage_of(len(prompt_ids), self.choices.generated_tokens(), output)
            report = dict(usage=usage, memory=memory_usage(plan, output), timings=timings)
            if self.include_usage:
                self.tail = ChatCompletionChunk(id=self.chunk_id, model=self.model, choices=[], **report)
            else:
                chunk.usage, chunk.memory, chunk.timings = report["usage"], report["memory"], report["timings"]
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

    def closing(self) -> list[str]:
        """The events after the last output: the usage chunk when asked for, then [DONE]."""
        tail = [f"data: {self.tail.model_dump_json(exclude_none=True)}\n\n"] if self.tail is not None else []
        return tail + ["data: [DONE]\n\n"]
