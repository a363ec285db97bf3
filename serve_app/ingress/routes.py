"""The HTTP routes of this service's own API (ChatRoutes), for whichever deployment is the ingress.

The router deployment (serve_app.ingress.router.ChatAPI, `routing: router`, the default) runs them
in its own Serve replicas in front of one LLMReplica deployment per shard, and sends each user to
the replica holding that user's memory; it imports neither torch nor vLLM (tests/test_layout.py
checks), so it starts in a second and stays light. With `routing: direct` the same routes run
inside each LLM replica (serve_app.direct_ingress), one Serve hop fewer. Subclasses add the
Mem0 platform's routes (.mem0_routes, and its methods not implemented yet: .mem0_unimplemented), text
completions (.completion_routes), models and embeddings (.openai_routes) and the Responses API
(.responses_routes).

Routes (OpenAI chat completions, memory operations in Mem0's shapes: serve_app.memory_protocol;
a memory route answers with or without a trailing slash, as Mem0's clients call it):
    POST   /v1/chat/completions          chat; `user` selects the memory, `memory` the mode
    POST   /v1/completions               text completion, no memory (serve_app.ingress.completion_routes)
    POST   /v1/responses                 the Responses API: a chat in its dialect (serve_app.ingress.responses_routes)
    POST   /v1/embeddings, GET /v1/models[/{id}]   (serve_app.ingress.openai_routes)
    POST   /v1/memories                  add (messages -> extracted facts, or facts given)
    GET    /v1/memories?user_id=         get_all
    POST   /v1/memories/search           search
    GET    /v1/memories/{id}             get
    PUT    /v1/memories/{id}             update (text re-encodes the fact's KV; metadata)
    DELETE /v1/memories/{id}             delete
    DELETE /v1/memories?user_id=         delete_all (and the user's stored responses)
    GET    /v1/memories/{id}/history     history (a list of events, oldest first)
    GET    /v1/shards                    per-shard statistics (bytes per tier, facts, queue); admin
    POST   /v1/admin/keys                create an API key (admin); GET lists, DELETE /{key_id} revokes
    GET    /health                       Redis, and each replica's engine and shard (no key needed)

Who may do what (serve_app.ingress.auth): with `auth.mode: keys` every route but /health needs a key,
checked with the body's size, depth and deadline and the key's rates by serve_app.ingress.gate
before the body is read (401, 429, 413, 408, 400); a key acts only for its users (403, and a
user's own rates: `_authorize`); fact-id routes answer one 404 for "not yours", "does not exist"
and any id not of the minted shape (memory.records.is_fact_id). Undeclared query parameters are
400 and unknown routes 404 `route_not_found` (serve_app.ingress.strict_routes).
The application is assembled by serve_app.app.build_app.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, AsyncIterator, Awaitable

from fastapi import Depends, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from memory.directory import UserDirectory
from memory.response_store import ResponseStore
from memory.records import StoreUnavailable, is_fact_id
from serve_app.ingress.admission import Admission, RequestClass, Refused
from serve_app.ingress.auth import Authenticator, KeyStore, Principal, caller
from serve_app.ingress.replica_calls import answer_unless, with_failover
from serve_app.ingress.errors import UNAVAILABLE_RETRY_AFTER_S, http_error, install_error_handlers, store_unavailable
from serve_app.ingress.gate import RequestGate
from serve_app.ingress.strict_routes import register, strict_app
from serve_app.memory_protocol import (
    AddMemoryRequest,
    MemoryHistoryItem,
    MemoryItem,
    MemorySearchHit,
    SearchMemoryRequest,
    UpdateMemoryRequest,
    add_answer,
)
from serve_app.protocol import ChatCompletionRequest, ChatCompletionResponse, RequestRejected
from serve_app.settings import ServiceSettings
from serve_app.stage_timings import StageClock, stage_histogram

logger = logging.getLogger(__name__)

api = strict_app(title="kv-memory-serve", description="LLM serving with per-user KV-injected memory.")
install_error_handlers(api)  # OpenAI-shaped 4xx/5xx bodies, documented in the OpenAPI schema


def serving_ingress() -> "ChatRoutes":
    """The ChatRoutes this Serve replica runs (ChatAPI, or a `routing: direct` LLM replica): the
    RequestGate's authenticator and body limit."""
    return serve.get_replica_context().servable_object


# Before routing, so before FastAPI reads a body: key (401), rates (429), body size, deadline and depth (413, 408, 400).
api.add_middleware(RequestGate, ingress=serving_ingress)


memory_route = functools.partial(register, api)  # a route at its path and its trailing-slash twin


class ChatRoutes:
    """The HTTP routes, for whichever deployment is the ingress: the ChatAPI router deployment
    (below) or, with `routing: direct`, each LLM replica itself (serve_app.direct_ingress).
    A subclass says where a shard's calls go (`_replica`, `_home_replica`, `num_shards`); what
    it returns answers the LLM replica's methods as `x.method.remote(...)`, like a Serve handle."""

    num_shards: int
    ingress_name: str  # in the X-KVMem-Route header: "router", or the shard of a direct replica

    def _init_routes(self, settings: ServiceSettings) -> None:
        self.settings = settings
        prefix = settings.memory.redis_prefix
        password = settings.redis_password_value()
        self.directory = UserDirectory.from_url(settings.redis_url, prefix, password=password)
        self.keys = KeyStore.from_url(settings.redis_url, prefix, settings.auth.cache_ttl_s, password=password)
        self.auth = Authenticator(settings.auth, self.keys)
        kept = settings.responses  # the Responses API's stored responses (serve_app.ingress.responses_routes)
        self.responses = ResponseStore.from_url(settings.redis_url, prefix, kept.store_ttl_s, kept.max_stored_per_key, password=password)
        self.max_body_bytes, self.body_timeout_s = settings.max_body_bytes, settings.body_timeout_s  # the RequestGate's bounds
        self.max_json_depth = settings.max_json_depth
        self.admission = Admission.of(settings)
        if getattr(self, "stage_seconds", None) is None:  # the LLM replica may have made it
            self.stage_seconds = stage_histogram()

    def _replica(self, shard: int, avoid: str | None = None) -> Any:
        """The calls of shard `shard`'s LLM replicas (but the replica `avoid`, whose engine is down)."""
        raise NotImplementedError

    def _home_replica(self) -> Any:
        """The replica for requests that touch no user's memory."""
        raise NotImplementedError

    def _replicas_running(self) -> int | None:
        """LLM replicas Serve runs now, over every shard (None: not known here)."""
        return None

    # ------------------------------------------------------------------ routing
    async def _shard_of_user(self, user_id: str) -> int:
        try:
            return await self.directory.shard_of(user_id, self.num_shards)
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from exc

    async def _replica_of_user(self, user_id: str) -> Any:
        return self._routable(await self._shard_of_user(user_id))

    def _routable(self, shard: int, avoid: str | None = None) -> Any:
        """The calls of shard `shard`'s replicas (but `avoid`), or a 503 at once while it has none running."""
        refusal = self._shard_refusal(shard)
        if refusal is not None:
            raise refusal
        return self._replica(shard, avoid)

    def _shard_refusal(self, shard: int) -> HTTPException | None:
        """Why a request for `shard` is answered 503 now (the router: serve_app.ingress.shard_availability)."""
        return None

    async def _authorize(self, principal: Principal, user_id: str, kind: RequestClass) -> None:
        """403 unless the key may act for `user_id`; 429 past the user's buckets (a key of several
        users: its own were spent in the RequestGate, serve_app.ingress.admission)."""
        self.auth.require_user(principal, user_id)
        try:
            self.admission.admit_user(principal, user_id, kind)
        except Refused as refused:
            if refused.hold_s > 0:
                async with self.admission.held(principal.key_id):
                    await asyncio.sleep(refused.hold_s)
            raise HTTPException(429, refused.message, refused.headers()) from refused

    async def _replica_of_fact(
        self, principal: Principal, fact_id: str, user_id: str | None, kind: RequestClass = "reads"
    ) -> tuple[DeploymentHandle, str]:
        """The replica and owner of a fact the caller may touch; one 404 for absent, not yours, and
        an id the service never mints (not looked up: it could name another Redis key)."""
        try:
            owner = await self.directory.owner_of_fact(fact_id) if is_fact_id(fact_id) else None
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from exc
        if owner is None or not principal.may_act_for(owner) or (user_id is not None and owner != user_id):
            raise HTTPException(status_code=404, detail=f"no memory {fact_id!r}")
        await self._authorize(principal, owner, kind)
        return await self._replica_of_user(owner), owner

    async def _answer(self, call: Awaitable[Any], shard: int | None = None) -> Any:
        """The replica's answer to a call, bounded in time, with its refusals as HTTP errors; a call to
        `shard` is given up (503) as soon as that shard's replica is known to be down."""
        try:
            if shard is None:
                return await asyncio.wait_for(call, self.settings.replica_call_timeout_s)
            return await answer_unless(call, lambda: self._shard_refusal(shard), self.settings.replica_call_timeout_s)
        except asyncio.TimeoutError as exc:
            timeout = self.settings.replica_call_timeout_s  # busy or restarting: a client should try again, as for any 503
            raise HTTPException(503, f"the replica gave no answer within {timeout:.0f} s", {"Retry-After": "5"}) from exc
        except Exception as exc:
            error = http_error(exc)
            if error is not None:
                raise error from exc
            raise

    def _memory_events(self, user_id: str, events: list[tuple[str, str, str | None]]) -> None:
        """A memory write's events ((ADD | UPDATE | DELETE, memory id, text)), once it is answered: the
        webhooks' (serve_app.ingress.webhook_routes); nothing here."""

    async def _wants_events(self, user_id: str, event: str) -> bool:
        """Whether some webhook wants `user_id`'s `event`s (then delete_all lists what it erases)."""
        return False

    # ------------------------------------------------------------------ chat
    @api.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        self, request: ChatCompletionRequest, response: Response, http: Request,
        principal: Principal = Depends(caller),
    ) -> ChatCompletionResponse | StreamingResponse:
        """The ingress's stages (auth, route, replica_first_event; serve_app.stage_timings) come
        back in a Server-Timing header and go to kvmem_stage_seconds; the replica's in `timings`.
        `auth` is the RequestGate's key check, before the body was read."""
        answer, headers = await self._routed_chat(request, http, principal)
        if not request.stream:
            response.headers.update(headers)
            return answer
        return self._relayed(*answer, headers)

    async def _routed_chat(self, request: ChatCompletionRequest, http: Request, principal: Principal) -> tuple[Any, dict[str, str]]:
        """A chat, authorized and run on its user's replica (or the home replica): its answer (a
        ChatCompletionResponse, or with stream=true the first event and the rest) and the headers
        that say where it ran and its stages (Server-Timing, X-KVMem-Route). Chats and the Responses
        API (serve_app.ingress.responses_routes) both come this way."""
        clock = StageClock()
        clock.add({"auth": getattr(http.state, "auth_ms", 0.0)})
        routed = clock.started
        shard: int | None = None
        if request.user:
            await self._authorize(principal, request.user, "chats")
            shard = self.directory.cached_shard(request.user)
            if shard is None:
                try:
                    shard = await self._shard_of_user(request.user)
                except HTTPException:
                    if request.memory.mode != "none":
                        raise  # a request that needs no memory is answered even while Redis is down
        # which ingress took the request and which shard answered it (routing is observable)
        route = f"{self.ingress_name} -> {'home' if shard is None else f'shard-{shard}'}"
        scope = None if self.settings.auth.mode == "off" else principal.cache_scope  # salts a user-less request
        called = clock.record("route", routed)

        async def ask(avoid: str | None) -> Any:  # once, or again on another replica of the shard (failover)
            replica = self._home_replica() if shard is None else self._routable(shard, avoid)
            if not request.stream:
                return await self._answer(replica.chat.remote(request, scope), shard)
            events = replica.options(stream=True).chat_stream.remote(request, scope)
            return await self._answer(events.__anext__(), shard), events  # a refusal comes as a status, not a stream

        answer = await with_failover(ask, self.settings.llm_replicas_per_shard > 1)
        clock.record("replica_first_event" if request.stream else "replica_answer", called)
        return answer, {"Server-Timing": self._timed(clock), "X-KVMem-Route": route}

    def _relayed(self, first: str, events: Any, headers: dict[str, str]) -> StreamingResponse:
        """A replica's server-sent events after `first` as the answer (_relay)."""
        return StreamingResponse(self._relay(first, events), media_type="text/event-stream", headers=headers)

    async def _relay(self, first: str, events: Any) -> AsyncIterator[str]:
        """A replica's server-sent events after `first`, each awaited at most replica_call_timeout_s
        (a stalled stream is closed)."""
        timeout = self.settings.replica_call_timeout_s
        yield first
        while True:
            try:
                event = await asyncio.wait_for(events.__anext__(), timeout)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                logger.warning("stream stalled for %.0f s; closing it", timeout)
                events.cancel()
                return
            yield event

    def _timed(self, clock: StageClock) -> str:
        """Records the ingress's stages (metrics) and gives them as a Server-Timing value."""
        clock.record("ingress", clock.started)
        clock.observe(self.stage_seconds)
        return clock.server_timing()

    # ------------------------------------------------------------------ memory
    @memory_route("POST", "/v1/memories")
    async def add_memories(
        self, request: AddMemoryRequest, principal: Principal = Depends(caller)
    ) -> dict[str, Any]:
        await self._authorize(principal, request.user_id, "writes")
        too_large = self.settings.add_limits.refusal(request)
        if too_large is not None:  # 413 before anything is stored (settings add_limits)
            message, param = too_large
            raise HTTPException(413, message) from RequestRejected(message, param, "request_too_large")
        result = await self._answer((await self._replica_of_user(request.user_id)).add_memory.remote(request))
        answer = add_answer(result)  # Mem0's shape, made here at the edge
        self._memory_events(request.user_id, [(r["event"], r["id"], None if r["event"] == "DELETE" else r.get("memory")) for r in answer["results"]])
        return answer

    @memory_route("GET", "/v1/memories")
    async def list_memories(
        self, user_id: str = Query(..., min_length=1, max_length=256), principal: Principal = Depends(caller),
    ) -> dict[str, list[MemoryItem]]:
        return {"results": await self._memories_of(principal, user_id)}

    async def _memories_of(self, principal: Principal, user_id: str) -> list[MemoryItem]:
        await self._authorize(principal, user_id, "reads")
        records = await self._answer((await self._replica_of_user(user_id)).get_all.remote(user_id))
        return [MemoryItem.of(r) for r in records]

    @memory_route("POST", "/v1/memories/search")
    async def search_memories(
        self, request: SearchMemoryRequest, principal: Principal = Depends(caller)
    ) -> dict[str, list[MemorySearchHit]]:
        await self._authorize(principal, request.user_id, "reads")
        replica = await self._replica_of_user(request.user_id)
        hits = await self._answer(replica.search.remote(request.user_id, request.query, top_k=request.limit))  # Mem0's v1 name, `limit`
        floor = request.threshold
        return {"results": [MemorySearchHit.of(h, request.user_id) for h in hits if floor is None or h.score >= floor]}

    @memory_route("GET", "/v1/memories/{fact_id}")
    async def get_memory(self, fact_id: str, user_id: str | None = None, principal: Principal = Depends(caller)) -> MemoryItem:
        replica, owner = await self._replica_of_fact(principal, fact_id, user_id)
        return MemoryItem.of(await self._answer(replica.get.remote(fact_id, owner)))

    @memory_route("PUT", "/v1/memories/{fact_id}")
    async def update_memory(
        self, fact_id: str, request: UpdateMemoryRequest, user_id: str | None = None,
        principal: Principal = Depends(caller),
    ) -> MemoryItem:
        replica, owner = await self._replica_of_fact(principal, fact_id, user_id, "writes")
        call = replica.update.remote(fact_id, owner, request.text, metadata=request.metadata, wait_for_kv=request.wait_for_kv)
        updated = MemoryItem.of(await self._answer(call))
        self._memory_events(owner, [("UPDATE", fact_id, updated.memory)])
        return updated

    @memory_route("DELETE", "/v1/memories/{fact_id}")
    async def delete_memory(
        self, fact_id: str, user_id: str | None = None, principal: Principal = Depends(caller)
    ) -> dict[str, Any]:
        replica, owner = await self._replica_of_fact(principal, fact_id, user_id, "writes")
        await self._answer(replica.delete.remote(fact_id, owner))
        self._memory_events(owner, [("DELETE", fact_id, None)])
        return {"message": f"memory {fact_id} deleted"}

    @memory_route("DELETE", "/v1/memories")
    async def delete_memories(
        self, user_id: str = Query(..., min_length=1, max_length=256), principal: Principal = Depends(caller),
    ) -> dict[str, Any]:
        await self._authorize(principal, user_id, "writes")
        replica = await self._replica_of_user(user_id)
        erased = [r.fact_id for r in await self._answer(replica.get_all.remote(user_id))] if await self._wants_events(user_id, "DELETE") else []
        deleted = await self._answer(replica.delete_all.remote(user_id))
        self._memory_events(user_id, [("DELETE", fact_id, None) for fact_id in erased])
        self.directory.forget_user(user_id)  # its placement is erased with its memory
        try:
            await self.responses.forget_user(user_id)  # and the responses stored for it (memory.response_store)
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from exc
        return {"message": f"{deleted} memories of {user_id} deleted", "deleted": deleted}

    @memory_route("GET", "/v1/memories/{fact_id}/history")
    async def memory_history(
        self, fact_id: str, user_id: str | None = None, principal: Principal = Depends(caller)
    ) -> list[MemoryHistoryItem]:
        replica, owner = await self._replica_of_fact(principal, fact_id, user_id)
        return [MemoryHistoryItem.of(e) for e in await self._answer(replica.history.remote(fact_id, owner))]

    # ------------------------------------------------------------------ misc
    @api.get("/health")
    async def service_health(self) -> Any:
        """Redis, and each replica's engine and memory shard; 503 naming whatever is not ok. Answers
        within about status_timeout_s whatever they are doing: a part that has not answered by then
        is reported as such.

        {"status": "ok", "redis": "ok", "redis_memory": {...}, "replicas": {"0": {"engine": "ok", "shard": "ok"}}};
        redis_memory (used_bytes, max_bytes, fraction) carries a `warning` past memory.redis_memory_warn_fraction."""
        limit = self.settings.status_timeout_s

        async def redis_status() -> str:
            try:
                await asyncio.wait_for(self.directory.ping(), limit)
                return "ok"
            except asyncio.TimeoutError:
                return f"no answer within {limit:g} s"
            except Exception as exc:  # reported, never raised
                return f"unreachable: {type(exc).__name__}: {exc}"[:300]

        async def replica_status(replica: Any) -> dict[str, str]:
            try:
                return await asyncio.wait_for(replica.health.remote(), limit)
            except asyncio.TimeoutError:
                return {"replica": f"no answer within {limit:g} s (busy, or restarting)"}
            except Exception as exc:
                return {"replica": f"unavailable: {type(exc).__name__}: {exc}"[:300]}

        shards = [self._replica(shard) for shard in range(self.num_shards)]
        memory = self.directory.memory_report(self.settings.memory.redis_memory_warn_fraction, limit)  # a warning, not a 503
        redis_ok, redis_memory, *replicas = await asyncio.gather(redis_status(), memory, *(replica_status(r) for r in shards))
        report: dict[str, Any] = {"redis": redis_ok, "redis_memory": redis_memory, "replicas": {str(i): r for i, r in enumerate(replicas)}}
        failing = [f"redis: {redis_ok}"] if redis_ok != "ok" else []
        failing += [f"replica {i} {part}: {state}" for i, r in enumerate(replicas) for part, state in r.items() if state != "ok"]
        report = {"status": "ok" if not failing else "; ".join(failing), **report}
        if (running := self._replicas_running()) is not None:  # below `wanted` while Serve replaces a replica
            report["llm_replicas"] = {"running": running, "wanted": self.num_shards * self.settings.llm_replicas_per_shard}
        if not failing:
            return JSONResponse(report)
        return JSONResponse(report, status_code=503, headers={"Retry-After": UNAVAILABLE_RETRY_AFTER_S})  # a part restarting or away
