"""The HTTP ingress (ChatAPI): routes each user to the replica holding that user's memory.

Runs in its own Serve replica in front of one LLMReplica deployment per shard; it imports
neither torch nor vLLM (tests/test_layout.py checks), so it starts in a second and stays light.

Routes (OpenAI chat completions plus Mem0-style memory operations):
    POST   /v1/chat/completions          chat; `user` selects the memory, `memory` the mode
    POST   /v1/memories                  add (messages -> extracted facts, or facts given)
    GET    /v1/memories?user_id=         get_all
    POST   /v1/memories/search           search
    GET    /v1/memories/{id}             get
    PUT    /v1/memories/{id}             update (re-encodes the fact's KV)
    DELETE /v1/memories/{id}             delete
    DELETE /v1/memories?user_id=         delete_all
    GET    /v1/memories/{id}/history     history
    GET    /v1/shards                    per-shard statistics (bytes per tier, facts, queue)

The application is assembled by serve_app.app.build_app.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from memory.fact_store import FactStore
from serve_app.protocol import (
    AddMemoryRequest,
    ChatCompletionRequest,
    ChatCompletionResponse,
    NotFound,
    RequestRejected,
    SearchMemoryRequest,
    UpdateMemoryRequest,
)
from serve_app.settings import ServiceSettings

api = FastAPI(title="kv-memory-serve", description="LLM serving with per-user KV-injected memory.")


def _http_error(exc: BaseException) -> HTTPException | None:
    """The HTTP error for a replica's exception (Ray wraps it; report the original message)."""
    cause = getattr(exc, "cause", None) or exc
    message = str(cause.args[0] if cause.args else cause)
    if isinstance(cause, RequestRejected):
        return HTTPException(status_code=400, detail=message)
    if isinstance(cause, NotFound):
        return HTTPException(status_code=404, detail=message)
    return None


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
@serve.ingress(api)
class ChatAPI:
    """The router: user -> shard (assigned once, kept in Redis) -> that shard's replica."""

    def __init__(self, replicas: list[DeploymentHandle], settings: ServiceSettings) -> None:
        self.replicas = replicas
        self.settings = settings
        self.store = FactStore.from_url(settings.redis_url, settings.memory.redis_prefix)

    # ------------------------------------------------------------------ routing
    def _replica_of_user(self, user_id: str) -> DeploymentHandle:
        return self.replicas[self.store.shard_of(user_id, len(self.replicas))]

    def _replica_of_fact(self, fact_id: str, user_id: str | None) -> tuple[DeploymentHandle, str]:
        owner = self.store.user_of_fact(fact_id)
        if owner is None or (user_id is not None and owner != user_id):
            raise HTTPException(status_code=404, detail=f"no memory {fact_id!r}")
        return self._replica_of_user(owner), owner

    @staticmethod
    async def _answer(call: Any) -> Any:
        """The replica's answer to a call, with its refusals as HTTP errors."""
        try:
            return await call
        except Exception as exc:
            error = _http_error(exc)
            if error is not None:
                raise error from exc
            raise

    # ------------------------------------------------------------------ chat
    @api.post("/v1/chat/completions", response_model=None)
    async def chat_completions(self, request: ChatCompletionRequest) -> ChatCompletionResponse | StreamingResponse:
        replica = self._replica_of_user(request.user) if request.user else self.replicas[0]
        if not request.stream:
            return await self._answer(replica.chat.remote(request))
        events = replica.options(stream=True).chat_stream.remote(request)
        try:  # a rejected request fails on its first event: answer it with a status, not a stream
            first = await events.__anext__()
        except Exception as exc:
            error = _http_error(exc)
            if error is not None:
                raise error from exc
            raise

        async def relay() -> AsyncIterator[str]:
            yield first
            async for event in events:
                yield event

        return StreamingResponse(relay(), media_type="text/event-stream")

    # ------------------------------------------------------------------ memory
    @api.post("/v1/memories")
    async def add_memory(self, request: AddMemoryRequest) -> dict[str, Any]:
        return await self._answer(self._replica_of_user(request.user_id).add_memory.remote(request))

    @api.get("/v1/memories")
    async def get_all(self, user_id: str = Query(..., min_length=1)) -> dict[str, Any]:
        records = await self._answer(self._replica_of_user(user_id).get_all.remote(user_id))
        return {"results": [r.model_dump() for r in records]}

    @api.post("/v1/memories/search")
    async def search(self, request: SearchMemoryRequest) -> dict[str, Any]:
        replica = self._replica_of_user(request.user_id)
        hits = await self._answer(replica.search.remote(request.user_id, request.query, request.limit))
        return {"results": [{"id": h.fact_id, "memory": h.text, "score": h.score, "source_id": h.source_id} for h in hits]}

    @api.get("/v1/memories/{fact_id}")
    async def get(self, fact_id: str, user_id: str | None = None) -> dict[str, Any]:
        replica, owner = self._replica_of_fact(fact_id, user_id)
        return (await self._answer(replica.get.remote(fact_id, owner))).model_dump()

    @api.put("/v1/memories/{fact_id}")
    async def update(self, fact_id: str, request: UpdateMemoryRequest, user_id: str | None = None) -> dict[str, Any]:
        replica, owner = self._replica_of_fact(fact_id, user_id)
        return (await self._answer(replica.update.remote(fact_id, owner, request.text))).model_dump()

    @api.delete("/v1/memories/{fact_id}")
    async def delete(self, fact_id: str, user_id: str | None = None) -> dict[str, Any]:
        replica, owner = self._replica_of_fact(fact_id, user_id)
        await self._answer(replica.delete.remote(fact_id, owner))
        return {"message": f"memory {fact_id} deleted"}

    @api.delete("/v1/memories")
    async def delete_all(self, user_id: str = Query(..., min_length=1)) -> dict[str, Any]:
        deleted = await self._answer(self._replica_of_user(user_id).delete_all.remote(user_id))
        return {"message": f"{deleted} memories of {user_id} deleted", "deleted": deleted}

    @api.get("/v1/memories/{fact_id}/history")
    async def history(self, fact_id: str, user_id: str | None = None) -> dict[str, Any]:
        replica, owner = self._replica_of_fact(fact_id, user_id)
        events = await self._answer(replica.history.remote(fact_id, owner))
        return {"results": [e.model_dump() for e in events]}

    @api.get("/v1/shards")
    async def shards(self) -> dict[str, Any]:
        return {"results": [await self._answer(r.stats.remote()) for r in self.replicas]}

    # ------------------------------------------------------------------ misc
    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.settings.served_model_name, "object": "model"}]}

    @api.get("/health")
    async def health(self) -> dict[str, Any]:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(self.settings.redis_url, socket_timeout=2)
        try:
            await client.ping()
        except Exception as exc:  # report, do not crash the ingress
            raise HTTPException(status_code=503, detail=f"redis unreachable: {exc}") from exc
        finally:
            await client.aclose()
        return {"llm": "ok", "redis": "ok"}
