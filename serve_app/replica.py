"""LLMReplica: a Ray Serve deployment that owns one vLLM AsyncLLM engine and its memory shard.

One replica per GPU (per engine on CPU), each its own deployment (`LLMReplica_<i>`) so the
router can send a user to the one replica holding that user's memory. At start the replica
starts (or finds) its MemoryShard actor, opens the engine with the KV-memory connector over
the shard's arena, and runs an EncodeDriver in the background (it picks up facts queued by a
shard rebuild). A chat request with a `user` asks the shard for a plan (top-k facts, token
ids, kv_transfer_params) and runs it; the replica checks the context length first, so a
too-long prompt gets a clear 400 and the engine never sees it. Prometheus metrics go through
ray.serve.metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, AsyncIterator, Iterator

from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram

from actors.shard_client import ShardClient
from memory.fact_store import FactEvent, FactRecord, NewFact, Turn, UnknownFact
from memory.planner import MemoryHit
from serve_app.protocol import (
    AddMemoryRequest,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionChunk,
    ChatMessage,
    ChunkChoice,
    ChunkDelta,
    MemoryUsage,
    NotFound,
    RequestRejected,
    Usage,
)
from serve_app.settings import ServiceSettings

logger = logging.getLogger(__name__)

_TTFT_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]


def _count(counter: Counter, value: float) -> None:
    """Counter.inc refuses 0 (ray.util.metrics); skip empty increments."""
    if value > 0:
        counter.inc(value)


@contextlib.contextmanager
def _not_found() -> Iterator[None]:
    """UnknownFact from the shard (no such fact, or another user's) as the API's NotFound."""
    try:
        yield
    except UnknownFact as exc:
        raise NotFound(str(exc.args[0] if exc.args else exc)) from None


@serve.deployment(max_ongoing_requests=64, health_check_period_s=10, health_check_timeout_s=60)
class LLMReplica:
    def __init__(self, settings: ServiceSettings, shard_id: int = 0) -> None:
        import ray
        from transformers import AutoTokenizer

        from memory.prompting import PromptLayout
        from actors.shard_actor import start_shard_actor
        from connector.engine_config import kv_transfer_config
        from serve_app.engine import build_async_engine

        self.settings = settings
        self.shard_id = shard_id
        model = settings.resolved_model()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.layout = PromptLayout(self.tokenizer, settings.memory.instruction)
        kv_dtype = "bfloat16" if settings.engine.dtype == "auto" else settings.engine.dtype  # SmolLM2/Llama: bf16
        actor = start_shard_actor(
            shard_id, settings.memory, model, kv_dtype, settings.redis_url, settings.namespace, settings.shard_num_gpus
        )
        self.shard = ShardClient(actor, timeout_s=settings.shard_call_timeout_s)
        arena_path = ray.get(actor.arena_path.remote(), timeout=600)  # the shard's first start loads its models
        connector = kv_transfer_config(arena_path, device_pages=settings.memory.arena.device_pages)
        self.engine = build_async_engine(settings.engine, model, kv_transfer_config=connector)
        self._driver_task: asyncio.Task | None = None
        from serve_app.encode_driver import EncodeDriver

        self.ttft = Histogram("kvmem_ttft_seconds", description="Engine time to first token.", boundaries=_TTFT_BOUNDARIES_S, tag_keys=("mode",))
        self.requests = Counter("kvmem_requests_total", description="Chat requests by outcome.", tag_keys=("outcome",))
        self.generated_tokens = Counter("kvmem_generated_tokens_total", description="Tokens generated.")
        self.injected_tokens = Counter("kvmem_injected_tokens_total", description="Prompt tokens supplied by KV injection.")
        self.facts_encoded = Counter("kvmem_facts_encoded_total", description="Fact KV entries captured.")
        self.encode_seconds = Counter("kvmem_encode_seconds_total", description="Engine time spent encoding facts.")
        self.arena_bytes = Gauge("kvmem_arena_bytes", description="Fact KV bytes held, by tier.", tag_keys=("tier", "shard"))
        self.facts_gauge = Gauge("kvmem_facts", description="Facts held by the shard.", tag_keys=("shard",))
        self.pending_gauge = Gauge("kvmem_pending_encodes", description="Facts waiting for their KV.", tag_keys=("shard",))

        def on_batch(live: int, seconds: float) -> None:
            _count(self.facts_encoded, live)
            _count(self.encode_seconds, seconds)

        self.driver = EncodeDriver(self.shard, self.engine, settings.memory.encode_batch, on_batch)

    # ------------------------------------------------------------------ background work
    def _ensure_driver(self) -> None:
        if self._driver_task is None or self._driver_task.done():
            self._driver_task = asyncio.get_running_loop().create_task(self.driver.run_forever())


    # ------------------------------------------------------------------ chat
    async def _run(self, request: ChatCompletionRequest) -> AsyncIterator[tuple[Any, list[int], Any]]:
        """Plan (memory, context check) and run one chat request; yields (engine output,
        prompt ids, memory plan) as the engine produces tokens. Raises RequestRejected before
        the engine sees anything."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._ensure_driver()
        messages = [m.model_dump() for m in request.messages]
        max_tokens = request.max_tokens or self.settings.default_max_tokens
        limit = self.settings.engine.max_model_len
        plan = None
        if request.user and request.memory.mode != "none":
            # facts that do not fit next to the conversation are left out, least relevant first
            plan = await self.shard.plan_chat(
                request.user, messages, request.memory.top_k, request.memory.mode, limit - max_tokens
            )
            prompt_ids = plan.prompt_token_ids
        else:
            prompt_ids = self.layout.plain_prompt_ids(messages)
        if len(prompt_ids) + max_tokens > limit:
            self.requests.inc(tags={"outcome": "rejected"})
            raise RequestRejected(
                f"prompt of {len(prompt_ids)} tokens plus max_tokens={max_tokens} exceeds the "
                f"context length of {limit} tokens"
            )
        extra = {"kv_transfer_params": plan.kv_transfer_params} if plan is not None and plan.kv_transfer_params else None
        params = SamplingParams(
            max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p, seed=request.seed, extra_args=extra
        )
        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        if plan is not None and plan.cache_salt:
            prompt["cache_salt"] = plan.cache_salt
        mode = plan.mode if plan is not None else "none"
        start = time.perf_counter()
        first_token_at: float | None = None
        final = None
        async for output in self.engine.generate(prompt, params, request_id=f"chat-{uuid.uuid4().hex}"):
            if first_token_at is None and output.outputs and output.outputs[0].token_ids:
                first_token_at = time.perf_counter()
                self.ttft.observe(first_token_at - start, tags={"mode": mode})
            final = output
            yield output, prompt_ids, plan
        assert final is not None, "engine returned no output"
        self.requests.inc(tags={"outcome": "ok"})
        _count(self.generated_tokens, len(final.outputs[0].token_ids))
        if plan is not None:
            _count(self.injected_tokens, plan.injected_tokens)

    @staticmethod
    def _memory_usage(plan: Any, output: Any) -> MemoryUsage | None:
        if plan is None:
            return None
        return MemoryUsage(
            mode=plan.mode,
            fact_ids=[f.fact_id for f in plan.facts],
            injected_tokens=plan.injected_tokens,
            cached_tokens=output.num_cached_tokens or 0,
        )

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        final = prompt_ids = plan = None
        async for final, prompt_ids, plan in self._run(request):
            pass
        completion = final.outputs[0]
        return ChatCompletionResponse(
            model=self.settings.served_model_name,
            choices=[ChatChoice(message=ChatMessage(role="assistant", content=completion.text), finish_reason=completion.finish_reason)],
            usage=Usage(
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(completion.token_ids),
                total_tokens=len(prompt_ids) + len(completion.token_ids),
            ),
            memory=self._memory_usage(plan, final),
        )

    async def chat_stream(self, request: ChatCompletionRequest) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chat.completion.chunk format, then `data: [DONE]`.
        The last chunk carries the finish reason, usage and memory report."""
        chunk_id = f"chatcmpl-{uuid.uuid4().hex}"
        sent = 0
        first = True
        async for output, prompt_ids, plan in self._run(request):
            completion = output.outputs[0]
            delta = completion.text[sent:]
            sent = len(completion.text)
            done = output.finished
            if not delta and not done and not first:
                continue
            chunk = ChatCompletionChunk(
                id=chunk_id,
                model=self.settings.served_model_name,
                choices=[
                    ChunkChoice(
                        delta=ChunkDelta(role="assistant" if first else None, content=delta or None),
                        finish_reason=completion.finish_reason if done else None,
                    )
                ],
            )
            first = False
            if done:
                chunk.usage = Usage(
                    prompt_tokens=len(prompt_ids),
                    completion_tokens=len(completion.token_ids),
                    total_tokens=len(prompt_ids) + len(completion.token_ids),
                )
                chunk.memory = self._memory_usage(plan, output)
            yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ memory operations
    async def add_memory(self, request: AddMemoryRequest) -> dict[str, Any]:
        """Mem0 add: record turns, extract or take facts, store them, encode their KV."""
        from serve_app.extraction import extract_facts

        self._ensure_driver()
        user = request.user_id
        order = await self.shard.next_turn_order(user)
        turns = [Turn(**t.model_dump(), order=order + i) for i, t in enumerate(request.turns or [])]
        order += len(turns)
        if request.messages:
            base = uuid.uuid4().hex[:8]
            turns += [
                Turn(turn_id=f"m-{base}-{i}", speaker=m.role, text=m.content, order=order + i)
                for i, m in enumerate(request.messages)
            ]
        if turns:
            await self.shard.add_turns(user, turns)
        facts: list[NewFact] = []
        if request.messages and request.infer:
            user_turns = [t for t in turns if t.speaker == "user"]
            facts += await extract_facts(self.engine, self.layout, user_turns, self.settings.memory.max_facts_per_turn)
        elif request.messages:
            facts += [NewFact(text=t.text, source_id=t.turn_id) for t in turns if t.speaker == "user"]
        source = request.source_id or (turns[-1].turn_id if turns else None)
        facts += [NewFact(text=text, source_id=source) for text in request.facts or []]
        results = await self.shard.add_facts(user, facts)
        await self.driver.drain()  # the added facts' KV is in place when add returns
        return {"results": results}

    async def search(self, user_id: str, query: str, limit: int) -> list[MemoryHit]:
        return await self.shard.search(user_id, query, limit)

    async def get_all(self, user_id: str) -> list[FactRecord]:
        return await self.shard.get_all(user_id)

    async def get(self, fact_id: str, user_id: str) -> FactRecord:
        with _not_found():
            return await self.shard.get(fact_id, user_id)

    async def update(self, fact_id: str, user_id: str, text: str) -> FactRecord:
        """New text: the fact's KV is re-encoded before this returns."""
        self._ensure_driver()
        with _not_found():
            record = await self.shard.update(fact_id, user_id, text)
        await self.driver.drain()
        return record

    async def delete(self, fact_id: str, user_id: str) -> FactRecord:
        with _not_found():
            return await self.shard.delete(fact_id, user_id)

    async def delete_all(self, user_id: str) -> int:
        return await self.shard.delete_all(user_id)

    async def history(self, fact_id: str, user_id: str) -> list[FactEvent]:
        with _not_found():
            return await self.shard.history(fact_id, user_id)

    async def stats(self) -> dict[str, Any]:
        self._ensure_driver()
        result = await self.shard.stats()
        self._export_stats(result)
        return result

    def _export_stats(self, stats: dict[str, Any]) -> None:
        shard = str(self.shard_id)
        self.arena_bytes.set(stats["host_bytes_used"], tags={"tier": "host", "shard": shard})
        self.arena_bytes.set(stats["device_bytes_used"], tags={"tier": "device", "shard": shard})
        self.facts_gauge.set(stats["facts"], tags={"shard": shard})
        self.pending_gauge.set(stats["pending_encodes"], tags={"shard": shard})

    async def check_health(self) -> None:
        self._ensure_driver()
        await self.engine.check_health()
        try:
            self._export_stats(await asyncio.wait_for(self.shard.stats(), timeout=5))
        except Exception as exc:  # a restarting shard is not an unhealthy engine
            logger.warning("shard %d stats unavailable: %s", self.shard_id, exc)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
