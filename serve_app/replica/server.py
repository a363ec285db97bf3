"""MemoryLLM / LLMReplica: one vLLM AsyncLLM engine and its memory shard, as a Ray Serve replica.

One replica per GPU (per engine on CPU). Behind the ChatAPI router each is its own deployment
(`LLMReplica_<i>`) so the router can send a user to the one replica holding that user's memory;
with `routing: direct` each is also the HTTP ingress (serve_app.direct_ingress). At start
the replica starts (or finds) its MemoryShard actor, opens the engine with the KV-memory connector
over the shard's arena, and runs an EncodeDriver in the background (it picks up facts queued by a
shard rebuild). A chat with a `user` asks the shard for a plan (top-k facts, token ids,
kv_transfer_params) and runs it; a too-long prompt gets a 400 before the engine sees it. Metrics:
ray.serve.metrics. A dead engine core is restarted in place (serve_app.replica.lifecycle);
check_health fails only when that does not work; health() reports engine and shard (text completions:
.text_completions; embeddings: .query_embeddings; the engine's first-request compile paid at start: .warm_up)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, AsyncIterator, Iterator

from jinja2 import TemplateError
from ray import serve

from actors.plan_channel import PlanClient, plan_channel_address
from actors.shard_client import ShardClient
from memory.composition import key_salt, user_salt
from memory.prompting import PromptLayout
from memory.add_plan import AddResult
from memory.records import FactEvent, FactRecord, MemoryHit, UnknownFact
from serve_app.completion_protocol import CompletionRequest, CompletionResponse
from serve_app.embeddings_protocol import EmbeddingRequest, EmbeddingResponse
from serve_app.memory_protocol import AddMemoryRequest
from serve_app.protocol import ChatCompletionRequest, ChatCompletionResponse, EngineUnavailable, NotFound, RequestRejected
from serve_app.replica.adding import MemoryAdds
from serve_app.replica.chat_responses import Choices, ChunkStream, completion_response
from serve_app.replica.encode_driver import EncodeDriver
from serve_app.replica.engine import resolve_dtype
from serve_app.replica.lifecycle import engine_dead, start_backends
from serve_app.replica.limits import TokenLimits
from serve_app.replica.metrics import ReplicaMetrics
from serve_app.replica.refusal_logs import RefusalsAreNotFailures
from serve_app.replica.sampling import choice_copies, engine_errors_as_ours, sampling_params
from serve_app.replica.scheduling import CHAT_PRIORITY, ChatsRunning
from serve_app.replica.query_embeddings import QueryEmbeddings
from serve_app.replica.text_completions import TextCompleter
from serve_app.replica.warm_up import WarmUps
from serve_app.replica.shard_watchdog import ShardWatchdog
from serve_app.replica.startup import ReplicaStart
from serve_app.shard_routing import replica_metadata
from serve_app.settings import ServiceSettings
from serve_app.stage_timings import StageClock, count_positive as _count

logger = logging.getLogger(__name__)

# A conversation this short is templated and tokenized on the event loop: that costs less than the
# hop to a worker thread and back (docs/measured.md).
INLINE_TEMPLATE_CHARS = 2000

logging.getLogger("ray.serve").addFilter(RefusalsAreNotFailures())  # a 4xx is no failed request to log


@contextlib.contextmanager
def _not_found() -> Iterator[None]:
    """UnknownFact from the shard (no such fact, or another user's) as the API's NotFound."""
    try:
        yield
    except UnknownFact as exc:
        raise NotFound(str(exc.args[0] if exc.args else exc)) from None


class MemoryLLM:
    """One vLLM engine with its memory shard: the replica's work, whichever deployment runs it
    (LLMReplica below, behind the ChatAPI router; or serve_app.direct_ingress.ReplicaIngress)."""

    def __init__(self, settings: ServiceSettings, shard_id: int = 0) -> None:
        from transformers import AutoTokenizer  # the process boundary: module docstring

        self.start = ReplicaStart()  # the start's phases and memory plan (serve_app.replica.startup)
        self.settings = settings
        self.shard_id = shard_id
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        model = settings.resolved_model()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.layout = PromptLayout(self.tokenizer, settings.memory.instruction, settings.memory.window_bridge, settings.memory.memory_closing)
        self.limits = TokenLimits(self.layout, settings)  # token bounds, checked before anything is stored or run
        kv_dtype = resolve_dtype(settings.engine)  # the shard's arena holds KV of the dtype engine_kwargs gives vLLM
        actor, self.keeper, self.engine_slot = start_backends(settings, shard_id, model, kv_dtype, self.start)
        self.keeper.on_swap = lambda engine: setattr(self.driver, "engine", engine)
        self.shard = ShardClient(
            actor, timeout_s=settings.shard_call_timeout_s, plan_channel=self._plan_channel(settings, shard_id), engine_slot=self.engine_slot.slot or 0
        )
        self.adds = MemoryAdds(lambda: self.engine, self.layout, self.shard, self.limits, settings.memory, self._user_salt)
        self.watchdog = ShardWatchdog(self.shard, settings.health_timeout_s, settings.shard_restart_after_s)
        self._driver_task: asyncio.Task | None = None
        self._stats_exported_at = 0.0
        self._last_stats: dict[str, Any] | None = None  # the shard's last statistics (stats() when it is busy)
        self._stats_at = 0.0

        self.metrics = ReplicaMetrics()
        self.stage_seconds = self.metrics.stage_seconds  # shared with the routes' stages (routing: direct)
        self.chats_running = ChatsRunning()  # the chats being served, which the encoder yields to
        self.driver = EncodeDriver.for_memory(self.shard, self.engine, settings.memory, self.metrics.encoded, self.chats_running)
        self.completions = TextCompleter(lambda: self.engine, self.tokenizer, self.limits, settings, self.chats_running, self.metrics,
                                         self.replica_id, self._user_salt, self._ensure_driver)  # POST /v1/completions
        self.embeddings = QueryEmbeddings(settings)  # POST /v1/embeddings' copy of the query embedder, loaded on its own thread
        # the engine's first-logprobs compile, paid now (serve_app.replica.warm_up); a rebuilt engine again
        self.warm_ups = WarmUps(list(self.tokenizer("Hello").input_ids), settings.engine_restart_timeout_s, settings.engine.warm_up)
        self.warm_ups.ensure(self.engine)

    @staticmethod
    def _plan_channel(settings: ServiceSettings, shard_id: int) -> Any:
        """The shard's plan channel (actors.plan_channel), unless settings turn it off."""
        if not settings.plan_channel:
            return None
        arena = settings.memory.arena_path(settings.namespace, shard_id)
        return PlanClient(plan_channel_address(str(arena)), settings.plan_channel_timeout_s)

    @property
    def engine(self) -> Any:
        """The replica's AsyncLLM (replaced in place when its engine core dies: keeper)."""
        return self.keeper.engine

    # ------------------------------------------------------------------ background work
    def _ensure_driver(self) -> None:
        self.keeper.watch()
        self.warm_ups.ensure(self.engine)
        if self._driver_task is None or self._driver_task.done():
            self._driver_task = asyncio.get_running_loop().create_task(self.driver.run_forever())

    # ------------------------------------------------------------------ chat
    async def _prepare(self, request: ChatCompletionRequest, clock: StageClock) -> tuple[list[int], Any, Any]:
        """(prompt ids, memory plan, SamplingParams) of a chat request, or RequestRejected /
        NotFound (unknown model) before the engine sees anything (serve_app.replica.limits, .sampling);
        the plan's stages go on `clock`. EngineUnavailable at once while the engine is down."""
        if engine_dead(self.engine):
            raise EngineUnavailable(f"the engine of this replica is down: {self.keeper.status()}", self.replica_id)
        if request.model is not None and request.model != self.settings.served_model_name:
            raise NotFound(
                f"the model {request.model!r} does not exist; this service serves {self.settings.served_model_name!r}",
                param="model",
                code="model_not_found",
            )
        messages = request.prompt_messages()
        asked = request.requested_max_tokens
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        planned = self.limits.planned_output(asked, param)
        plan = None
        # facts that do not fit next to the conversation are left out, least relevant first
        query = request.memory_query(messages, self.limits.context - planned)
        try:
            if query is not None:
                called = time.perf_counter()
                plan = await self.shard.plan_chat(query)
                clock.record("plan_call", called)
                clock.add(plan.timings)
                clock.stages["shard_hop"] = clock.stages["plan_call"] - sum(plan.timings.values())
                prompt_ids = plan.prompt_token_ids
            elif sum(len(m["content"]) for m in messages) <= INLINE_TEMPLATE_CHARS:
                prompt_ids = self.layout.plain_prompt_ids(messages)
            else:  # a long conversation would hold the event loop for milliseconds: on a worker thread
                prompt_ids = await asyncio.to_thread(self.layout.plain_prompt_ids, messages)
        except TemplateError as exc:  # e.g. a template that needs alternating user/assistant roles
            raise RequestRejected(f"the model's chat template refuses this conversation: {exc}", param="messages") from None
        max_tokens = self.limits.output_tokens(len(prompt_ids), asked, planned, param)
        extra = {"kv_transfer_params": plan.kv_transfer_params} if plan is not None and plan.kv_transfer_params else None
        return prompt_ids, plan, sampling_params(request, max_tokens, extra)

    async def _run(
        self, request: ChatCompletionRequest, cache_scope: str | None = None
    ) -> AsyncIterator[tuple[Any, list[int], Any, dict[str, float]]]:
        """Plan and run one chat request; yields (engine output, prompt ids, memory plan, stage
        timings in ms) as the engine produces tokens (cumulative outputs). Refusals are raised
        before the engine runs. Every request is salted: by its user, else by `cache_scope` (the
        caller's API key id, Principal.cache_scope: a key's namespace, never a user's)."""
        from vllm.inputs import TokensPrompt  # the process boundary: module docstring

        clock = StageClock()
        self._ensure_driver()
        try:
            with self.chats_running.one():
                prompt_ids, plan, params = await self._prepare(request, clock)
            clock.record("prepare", clock.started)
        except (RequestRejected, NotFound):
            self.metrics.requests.inc(tags={"outcome": "rejected"})
            raise
        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        if plan is not None and plan.cache_salt:
            prompt["cache_salt"] = plan.cache_salt
        elif request.user:
            prompt["cache_salt"] = self._user_salt(request.user)
        elif cache_scope:
            prompt["cache_salt"] = key_salt(self.settings.memory.redis_prefix, cache_scope)
        mode = plan.mode if plan is not None else "none"
        start = time.perf_counter()
        first_token_at: float | None = None
        timings: dict[str, float] | None = None  # final once the first token is in
        final, generated = None, Choices()
        with self.chats_running.one(), engine_errors_as_ours(self.replica_id):  # e.g. a JSON schema the engine cannot compile: 400
            async for output in self.engine.generate(prompt, params, request_id=f"chat-{uuid.uuid4().hex}", priority=CHAT_PRIORITY):
                if first_token_at is None and output.outputs and output.outputs[0].token_ids:
                    first_token_at = clock.record("engine_ttft", start)
                    clock.record("replica_ttft", clock.started)
                    self.metrics.ttft.observe(first_token_at - start, tags={"mode": mode})
                    clock.observe(self.stage_seconds)
                    timings = clock.rounded()
                final = output
                generated.update(output)
                yield output, prompt_ids, plan, timings if timings is not None else clock.rounded()
        assert final is not None, "engine returned no output"
        self.metrics.requests.inc(tags={"outcome": "ok"})
        _count(self.metrics.generated_tokens, generated.engine_tokens())
        if plan is not None:
            _count(self.metrics.injected_tokens, plan.injected_tokens)

    async def chat(self, request: ChatCompletionRequest, cache_scope: str | None = None) -> ChatCompletionResponse:
        final = prompt_ids = plan = timings = None
        choices = Choices(choice_copies(request.temperature, request.n))
        async for final, prompt_ids, plan, timings in self._run(request, cache_scope):
            choices.update(final)
        return completion_response(request, self.settings.served_model_name, choices, final, prompt_ids, plan, timings, self.tokenizer)

    async def chat_stream(self, request: ChatCompletionRequest, cache_scope: str | None = None) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chat.completion.chunk format (serve_app.replica.chat_responses.ChunkStream)."""
        stream = ChunkStream(request, self.settings.served_model_name, self.tokenizer, choice_copies(request.temperature, request.n))
        async for output, prompt_ids, plan, timings in self._run(request, cache_scope):
            event = stream.event(output, prompt_ids, plan, timings)
            if event is not None:
                yield event
        for event in stream.closing():
            yield event

    # ------------------------------------------------------------------ text completions
    async def complete(self, request: CompletionRequest, cache_scope: str | None = None) -> CompletionResponse:
        """POST /v1/completions (serve_app.replica.text_completions)."""
        return await self.completions.complete(request, cache_scope)

    async def complete_stream(self, request: CompletionRequest, cache_scope: str | None = None) -> AsyncIterator[str]:
        """POST /v1/completions with stream: server-sent events (serve_app.replica.text_completions)."""
        async for event in self.completions.complete_stream(request, cache_scope):
            yield event

    # ------------------------------------------------------------------ embeddings
    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """POST /v1/embeddings (serve_app.replica.query_embeddings)."""
        return await self.embeddings.embed(request)

    def _user_salt(self, user_id: str) -> str:
        """The user's prefix-cache scope: their requests share cached blocks with no one else."""
        return user_salt(self.settings.memory.redis_prefix, user_id)

    # ------------------------------------------------------------------ memory operations
    async def add_memory(self, request: AddMemoryRequest) -> AddResult:
        """Mem0 add, in two shard calls around the engine's work (serve_app.replica.adding); the
        records are durable when this answers, their KV follows (awaited when `wait_for_kv`)."""
        self._ensure_driver()
        with engine_errors_as_ours(self.replica_id):  # extraction and reconciliation run on the engine
            result = await self.adds.add(request)
        await self._acknowledge(result.live_fact_ids, request.wait_for_kv)
        return result

    async def _acknowledge(self, fact_ids: list[str], wait_for_kv: bool) -> None:
        """The facts are durable in Redis (appendfsync always): answer now and let the background
        encoder take their KV (woken at once, batched with other adds' facts), or, when the caller
        asked, wait for it first (bounded by memory.add_encode_wait_s)."""
        if wait_for_kv:
            await self.driver.settle(fact_ids, self.settings.memory.add_encode_wait_s)
        else:
            self.driver.wake()

    async def search(self, user_id: str, query: str, top_k: int) -> list[MemoryHit]:
        return await self.shard.search(user_id, query, top_k)

    async def get_all(self, user_id: str) -> list[FactRecord]:
        return await self.shard.get_all(user_id)

    async def get(self, fact_id: str, user_id: str) -> FactRecord:
        with _not_found():
            return await self.shard.get(fact_id, user_id)

    async def update(
        self, fact_id: str, user_id: str, text: str | None, *, metadata: dict[str, Any] | None = None, wait_for_kv: bool = False
    ) -> FactRecord:
        """New text and/or metadata (None keeps each), durable before this returns; the old KV is
        never injected again and the new one follows (awaited when `wait_for_kv`)."""
        self._ensure_driver()
        with _not_found():
            if text is None:  # a metadata-only update keeps the text
                text = (await self.shard.get(fact_id, user_id)).text
            await asyncio.to_thread(self.limits.check_fact, text, "text")
            record = await self.shard.update(fact_id, user_id, text, metadata)
        await self._acknowledge([fact_id], wait_for_kv)
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
        """The shard's statistics, waiting at most status_timeout_s for them; a shard busy longer gets
        its last known statistics, marked with their age (`stale_s`) and why."""
        self._ensure_driver()
        try:
            result = await asyncio.wait_for(self.shard.stats(), self.settings.status_timeout_s)
        except Exception as exc:  # noqa: BLE001 - busy, restarting or dead: report, never hang
            age = round(time.monotonic() - self._stats_at, 1) if self._last_stats else None
            result = {**(self._last_stats or {"shard": self.shard_id}), "stale_s": age,
                      "unavailable": f"{type(exc).__name__}: {exc}"[:300] or "no answer within status_timeout_s"}
        else:
            self._remember_stats(result)
        channel = self.shard.plan_channel  # how this replica's chat plans travel (None: through Ray)
        return {**result, **self.start.report(), "plan_channel": channel.address if channel else None, "engine_slot": self.engine_slot.slot}

    def _remember_stats(self, stats: dict[str, Any]) -> None:
        self._last_stats, self._stats_at = stats, time.monotonic()
        self.metrics.export_shard_stats(stats, self.shard_id)

    async def check_health(self) -> None:
        """Serve's probe: fails when the engine is dead and not coming back in place
        (serve_app.replica.lifecycle.EngineKeeper.failure), or at once when it died and the shard has
        other replicas (llm_replicas_per_shard > 1: they serve its users while Serve replaces this
        one), so Serve replaces the replica. It also probes the shard (serve_app.replica.shard_watchdog
        restarts one that is wedged)."""
        self._ensure_driver()
        failure = self.keeper.failure()
        if failure is not None:
            raise RuntimeError(f"engine {failure}")
        restarts = self.watchdog.restarts
        await self.watchdog.probe()
        _count(self.metrics.shard_restarts, self.watchdog.restarts - restarts)
        if time.monotonic() - self._stats_exported_at > 10:  # metrics, not health: at most every 10 s
            self._stats_exported_at = time.monotonic()
            try:
                self._remember_stats(await asyncio.wait_for(self.shard.stats(), timeout=self.settings.health_timeout_s))
            except Exception as exc:  # a restarting shard is not an unhealthy engine
                logger.warning("shard %d stats unavailable: %s", self.shard_id, exc)

    async def health(self) -> dict[str, str]:
        """{"engine": "ok" | "restarting: …" | "dead: …", "shard": "ok" | "…"}, at once: the engine's
        state is the keeper's, the shard's is the last probe's (Serve's health check probes it every
        2 s, serve_app.replica.shard_watchdog), so this never waits behind a busy shard."""
        self._ensure_driver()
        shard = self.watchdog.report()
        if self.watchdog.probed_at is None:  # no health check has probed it yet: one probe, bounded
            try:
                shard = await asyncio.wait_for(self.watchdog.probe(), self.settings.status_timeout_s)
            except asyncio.TimeoutError:
                shard = f"starting: the shard has not answered within {self.settings.status_timeout_s:g} s"
        return {"engine": self.keeper.status(), "shard": shard}

    def record_replica_metadata(self) -> dict[str, Any]:
        """Serve's hook: the shard this replica serves, for UserShardRouter (both topologies)."""
        return replica_metadata(self.shard_id, self.settings.llm_replicas)

    def __del__(self) -> None:
        keeper = getattr(self, "keeper", None)
        if keeper is not None:
            keeper.close()  # a shutdown, not a crash: no restart
            self.engine.shutdown()
            self.engine_slot.release()  # after the engine: its successor clears the slot's pins


# The replica behind the ChatAPI router deployment (`routing: router`), one deployment per shard.
LLMReplica = serve.deployment(max_ongoing_requests=64, health_check_period_s=2, health_check_timeout_s=30)(MemoryLLM)
