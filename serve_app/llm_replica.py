"""LLMReplica: a Ray Serve deployment that owns one vLLM AsyncLLM engine.

One replica per GPU (per engine on CPU). It renders the chat template itself so that it knows
the exact prompt token ids (the memory composition of later stages works on token ids), checks
the request against the context length before the engine sees it, and reports Prometheus
metrics through ray.serve.metrics.
"""

from __future__ import annotations

import time
import uuid

from ray import serve
from ray.serve.metrics import Counter, Histogram

from serve_app.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    RequestRejected,
    Usage,
)
from serve_app.settings import ServiceSettings

_TTFT_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]


@serve.deployment(max_ongoing_requests=64, health_check_period_s=10, health_check_timeout_s=60)
class LLMReplica:
    def __init__(self, settings: ServiceSettings) -> None:
        from transformers import AutoTokenizer

        from serve_app.engine import build_async_engine

        self.settings = settings
        model = settings.resolved_model()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.engine = build_async_engine(settings.engine, model)
        self.ttft = Histogram(
            "kvmem_ttft_seconds", description="Engine time to first token.", boundaries=_TTFT_BOUNDARIES_S
        )
        self.requests = Counter("kvmem_requests_total", description="Chat requests by outcome.", tag_keys=("outcome",))
        self.generated_tokens = Counter("kvmem_generated_tokens_total", description="Tokens generated.")

    def prompt_token_ids(self, request: ChatCompletionRequest) -> list[int]:
        messages = [m.model_dump() for m in request.messages]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompt_ids = self.prompt_token_ids(request)
        max_tokens = request.max_tokens or self.settings.default_max_tokens
        limit = self.settings.engine.max_model_len
        if len(prompt_ids) + max_tokens > limit:
            self.requests.inc(tags={"outcome": "rejected"})
            raise RequestRejected(
                f"prompt of {len(prompt_ids)} tokens plus max_tokens={max_tokens} exceeds the "
                f"context length of {limit} tokens"
            )
        params = SamplingParams(
            max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p, seed=request.seed
        )
        start = time.perf_counter()
        first_token_at: float | None = None
        final = None
        async for output in self.engine.generate(
            TokensPrompt(prompt_token_ids=prompt_ids), params, request_id=f"chat-{uuid.uuid4().hex}"
        ):
            if first_token_at is None and output.outputs and output.outputs[0].token_ids:
                first_token_at = time.perf_counter()
                self.ttft.observe(first_token_at - start)
            final = output
        assert final is not None, "engine returned no output"
        completion = final.outputs[0]
        self.requests.inc(tags={"outcome": "ok"})
        self.generated_tokens.inc(len(completion.token_ids))
        return ChatCompletionResponse(
            model=self.settings.served_model_name,
            choices=[
                ChatChoice(
                    message=ChatMessage(role="assistant", content=completion.text),
                    finish_reason=completion.finish_reason,
                )
            ],
            usage=Usage(
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(completion.token_ids),
                total_tokens=len(prompt_ids) + len(completion.token_ids),
            ),
        )

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
