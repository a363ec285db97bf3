"""A chat's server-sent events (chat.completion.chunk, from the replica) as the Responses API's events.

The events and their order are OpenAI's, as the `openai` client parses them (each with `type` and a
`sequence_number`, sent with its `event:` line): response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta (one per chunk
with text), response.output_text.done, response.content_part.done, response.output_item.done, then
response.completed (or response.incomplete at max_output_tokens). A stream the replica stops
sending ends with an `error` event. Imports neither torch nor vLLM: it runs in the ingress.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Awaitable, Callable

from serve_app.protocol import ChatCompletionChunk, MemoryUsage, Usage
from serve_app.responses_protocol import OutputMessage, OutputText, ResponseObject


class ResponseEvents:
    """One response's events, fed the chat's events in order; `finished` is the final response once
    the chat's last chunk came (None before, or when the stream broke off)."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.message = OutputMessage(status="in_progress", content=[])
        self.text = ""
        self.sequence = 0
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.memory: MemoryUsage | None = None
        self.timings: dict[str, float] | None = None
        self.finished: ResponseObject | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def _place(self) -> dict[str, Any]:
        return {"item_id": self.message.id, "output_index": 0, "content_index": 0}

    def opening(self) -> list[str]:
        started = self.response.model_dump(mode="json")
        item = self.message.model_dump(mode="json")
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **self._place(), part=OutputText(text="").model_dump(mode="json")),
        ]

    def feed(self, chat_event: str) -> list[str]:
        """The Responses events for one of the replica's chat events (`data: {...}`, or `data: [DONE]`)."""
        data = chat_event.strip().removeprefix("data:").strip()
        if not data or data == "[DONE]":
            if self.finished is None and self.finish_reason is not None:
                self.finished = self.response.finished(self.text, self.finish_reason, self.usage, self.memory, self.timings)
            return []
        chunk = ChatCompletionChunk.model_validate_json(data)
        events: list[str] = []
        for choice in chunk.choices[:1]:  # one output message (a Responses request has no `n`)
            if choice.delta.content:
                self.text += choice.delta.content
                events.append(self._event("response.output_text.delta", **self._place(), delta=choice.delta.content, logprobs=[]))
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        self.usage = chunk.usage or self.usage
        self.memory = chunk.memory or self.memory
        self.timings = chunk.timings or self.timings
        return events

    def closing(self) -> list[str]:
        """The closing events of the finished response (`finished`)."""
        final = self.finished
        assert final is not None, "the chat has not finished"
        message = final.output[0]
        part = OutputText(text=self.text).model_dump(mode="json")
        return [
            self._event("response.output_text.done", **self._place(), text=self.text, logprobs=[]),
            self._event("response.content_part.done", **self._place(), part=part),
            self._event("response.output_item.done", output_index=0, item=message.model_dump(mode="json")),
            self._event(f"response.{final.status}", response=final.model_dump(mode="json")),
        ]

    def broken_off(self) -> list[str]:
        """The events when the chat's stream ended without its last chunk."""
        return [self._event("error", code="server_error", message="the answer's stream broke off before it finished; retry", param=None)]


async def response_events(
    events: ResponseEvents, chat_events: AsyncIterator[str], on_finished: Callable[[ResponseObject], Awaitable[ResponseObject]]
) -> AsyncIterator[str]:
    """The Responses stream of a relayed chat stream (serve_app.ingress.routes.ChatRoutes._relay);
    `on_finished` (storing it) is awaited with the final response, and what it returns is sent in
    the closing events."""
    for event in events.opening():
        yield event
    async for chat_event in chat_events:
        for event in events.feed(chat_event):
            yield event
        if events.finished is not None:
            events.finished = await on_finished(events.finished)
            for event in events.closing():
                yield event
            return
    for event in events.broken_off():
        yield event
