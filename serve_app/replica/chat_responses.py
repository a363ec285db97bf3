"""OpenAI chat answers from vLLM outputs: one ChatCompletionResponse, or a stream of
server-sent `chat.completion.chunk` events (serve_app.protocol), each with the memory report
and the request's stage timings (serve_app.stage_timings). No engine calls here."""

from __future__ import annotations

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
    from serve_app.replica.sampling import choice_logprobs

    return choice_logprobs(completion, start, request.top_logprobs or 0, tokenizer) if request.logprobs else None


def completion_response(
    request: ChatCompletionRequest, model: str, final: Any, prompt_ids: list[int], plan: Any,
    timings: dict[str, float], tokenizer: Any,
) -> ChatCompletionResponse:
    """The non-streamed answer from the engine's final output."""
    completion = final.outputs[0]
    choice = ChatChoice(
        message=ResponseMessage(content=completion.text),
        logprobs=logprobs_of(request, completion, 0, tokenizer),
        finish_reason=completion.finish_reason,
    )
    return ChatCompletionResponse(
        model=model,
        choices=[choice],
        usage=usage_of(len(prompt_ids), len(completion.token_ids), final),
        memory=memory_usage(plan, final),
        timings=timings,
    )


class ChunkStream:
    """Turns the engine's cumulative outputs of one request into server-sent events. The finishing
    chunk carries usage, the memory report and the timings, or, with stream_options.include_usage,
    one more chunk with empty `choices` does (as OpenAI sends it); then `data: [DONE]`."""

    def __init__(self, request: ChatCompletionRequest, model: str, tokenizer: Any) -> None:
        self.request = request
        self.model = model
        self.tokenizer = tokenizer
        self.chunk_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.include_usage = bool(request.stream_options and request.stream_options.include_usage)
        self.sent_text = self.sent_tokens = 0
        self.first = True
        self.tail: ChatCompletionChunk | None = None

    def event(self, output: Any, prompt_ids: list[int], plan: Any, timings: dict[str, float]) -> str | None:
        """The event for the engine's latest output; None when it adds no text yet (a partial
        character, a possible stop string) and is neither the first nor the last."""
        completion = output.outputs[0]
        delta = completion.text[self.sent_text :]
        done = output.finished
        if not delta and not done and not self.first:
            return None
        choice = ChunkChoice(
            delta=ChunkDelta(role="assistant" if self.first else None, content=delta or None),
            logprobs=logprobs_of(self.request, completion, self.sent_tokens, self.tokenizer),
            finish_reason=completion.finish_reason if done else None,
        )
        self.sent_text, self.sent_tokens, self.first = len(completion.text), len(completion.token_ids), False
        chunk = ChatCompletionChunk(id=self.chunk_id, model=self.model, choices=[choice])
        if done:
            report = dict(usage=usage_of(len(prompt_ids), len(completion.token_ids), output), memory=memory_usage(plan, output), timings=timings)
            if self.include_usage:
                self.tail = ChatCompletionChunk(id=self.chunk_id, model=self.model, choices=[], **report)
            else:
                chunk.usage, chunk.memory, chunk.timings = report["usage"], report["memory"], report["timings"]
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

    def closing(self) -> list[str]:
        """The events after the last output: the usage chunk when asked for, then [DONE]."""
        tail = [f"data: {self.tail.model_dump_json(exclude_none=True)}\n\n"] if self.tail is not None else []
        return tail + ["data: [DONE]\n\n"]
