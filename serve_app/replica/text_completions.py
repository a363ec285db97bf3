"""TextCompleter: OpenAI's text completions (POST /v1/completions) on the LLM replica's engine.

The prompt is continued as it is: tokenized with the model's tokenizer (or given as its token ids,
each checked against the vocabulary), no chat template, no memory (memory conditions chats). The same bounds as a chat (serve_app.replica.limits: a 400
before the engine sees anything), the same sampling through vLLM's own protocol model
(serve_app.replica.sampling), the same priority and prefix-cache scope (a user's, or the API
key's). TextCompleter is held by MemoryLLM (serve_app.replica.server), which gives it what it uses
(the engine through a getter, since a rebuilt engine replaces it; the tokenizer, limits, settings,
the chats count, metrics) and answers Serve's `complete` / `complete_stream` calls through it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, AsyncIterator, Callable

from memory.composition import key_salt
from serve_app.completion_protocol import CompletionChoice, CompletionRequest, CompletionResponse
from serve_app.protocol import NotFound, RequestRejected
from serve_app.replica.chat_responses import Choices, usage_of
from serve_app.replica.limits import TokenLimits
from serve_app.replica.metrics import ReplicaMetrics
from serve_app.replica.sampling import choice_copies, completion_sampling_params, engine_errors_as_ours
from serve_app.replica.scheduling import CHAT_PRIORITY, ChatsRunning
from serve_app.settings import ServiceSettings
from serve_app.stage_timings import count_positive


class TextCompleter:
    """complete / complete_stream on the replica's engine (module docstring)."""

    def __init__(
        self,
        engine: Callable[[], Any],
        tokenizer: Any,
        limits: TokenLimits,
        settings: ServiceSettings,
        chats_running: ChatsRunning,
        metrics: ReplicaMetrics,
        replica_id: str,
        user_salt: Callable[[str], str],
        before_generating: Callable[[], None],
    ) -> None:
        self._engine, self.tokenizer, self.limits, self.settings = engine, tokenizer, limits, settings
        self.chats_running, self.metrics, self.replica_id = chats_running, metrics, replica_id
        self._user_salt, self._before_generating = user_salt, before_generating

    async def _completion_outputs(self, request: CompletionRequest, cache_scope: str | None) -> AsyncIterator[tuple[Any, int]]:
        """(engine output, prompt tokens) as the engine produces them (cumulative outputs)."""
        from vllm.inputs import TokensPrompt  # the replica's process boundary (serve_app.replica.server)

        self._before_generating()  # the replica's background work is running (MemoryLLM._ensure_driver)
        name = self.settings.served_model_name
        if request.model is not None and request.model != name:
            raise NotFound(f"the model {request.model!r} does not exist; this service serves {name!r}", param="model", code="model_not_found")
        planned = self.limits.planned_output(request.max_tokens, "max_tokens")
        prompt_ids = self._given_ids(request.token_ids) if request.token_ids is not None else (
            await asyncio.to_thread(lambda: list(self.tokenizer(request.text).input_ids))
        )
        max_tokens = self.limits.output_tokens(len(prompt_ids), request.max_tokens, planned, "max_tokens", "prompt")
        params = completion_sampling_params(request, max_tokens)
        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        if request.user:
            prompt["cache_salt"] = self._user_salt(request.user)
        elif cache_scope:
            prompt["cache_salt"] = key_salt(self.settings.memory.redis_prefix, cache_scope)
        generated = Choices()
        with self.chats_running.one(), engine_errors_as_ours(self.replica_id):
            async for output in self._engine().generate(prompt, params, request_id=f"cmpl-{uuid.uuid4().hex}", priority=CHAT_PRIORITY):
                generated.update(output)
                yield output, len(prompt_ids)
        self.metrics.requests.inc(tags={"outcome": "ok"})
        count_positive(self.metrics.generated_tokens, generated.engine_tokens())

    def _given_ids(self, ids: list[int]) -> list[int]:
        """A prompt given as token ids, each checked against the tokenizer's vocabulary (400 naming the first that is not)."""
        vocabulary = len(self.tokenizer)
        for position, token in enumerate(ids):
            if token >= vocabulary:
                raise RequestRejected(
                    f"prompt.{position}: token id {token} is not in the model's vocabulary ({vocabulary} tokens)",
                    param=f"prompt.{position}",
                    code="invalid_token_id",
                )
        return list(ids)

    async def complete(self, request: CompletionRequest, cache_scope: str | None = None) -> CompletionResponse:
        choices, final, prompt_tokens = Choices(choice_copies(request.temperature, request.n)), None, 0
        async for final, prompt_tokens in self._completion_outputs(request, cache_scope):
            choices.update(final)
        return CompletionResponse(
            model=self.settings.served_model_name,
            choices=[CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason) for c in choices.ordered()],
            usage=usage_of(prompt_tokens, choices.generated_tokens(), final),
        )

    async def complete_stream(self, request: CompletionRequest, cache_scope: str | None = None) -> AsyncIterator[str]:
        """Server-sent events: text deltas per choice; the usage in the last event (or, with
        stream_options.include_usage, in one more with empty `choices`); then `data: [DONE]`."""
        name, sent, choices = self.settings.served_model_name, {}, Choices(choice_copies(request.temperature, request.n))
        stream_id = f"cmpl-{uuid.uuid4().hex}"
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        async for output, prompt_tokens in self._completion_outputs(request, cache_scope):
            choices.update(output)
            deltas = []
            for c in output.outputs:
                delta = c.text[sent.get(c.index, 0):]
                if delta or c.finish_reason is not None:
                    deltas += [CompletionChoice(index=i, text=delta, finish_reason=c.finish_reason) for i in choices.indices(c)]
                sent[c.index] = len(c.text)
            event = CompletionResponse(id=stream_id, model=name, choices=deltas)
            if output.finished:
                usage = usage_of(prompt_tokens, choices.generated_tokens(), output)
                if include_usage:
                    yield f"data: {event.model_dump_json(exclude_none=True)}\n\n"
                    event = CompletionResponse(id=stream_id, model=name, choices=[])
                event.usage = usage
            if event.choices or event.usage is not None:
                yield f"data: {event.model_dump_json(exclude_none=True)}\n\n"
        yield "data: [DONE]\n\n"
