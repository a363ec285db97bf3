"""The floor of Ray Serve itself: no-op applications with the service's hop structure
(docs/bench.md)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from serve_app.ingress.routes import ChatRoutes, api
from serve_app.direct_ingress import LocalCalls
from serve_app.settings import ServiceSettings
from serve_app.ingress.shard_router import UserShardRouter
from serve_app.shard_routing import replica_metadata

EVENT = 'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":"ok"}}]}\n\n'
DONE = "data: [DONE]\n\n"


def one_event_stream() -> StreamingResponse:
    """The answer of every floor: one server-sent event and [DONE]."""

    async def events() -> AsyncIterator[str]:
        yield EVENT
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream")


chain_api = FastAPI()
direct_api = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
class FloorReplica:
    """Stands where LLMReplica stands: streams one event, no engine, no memory."""

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[str]:
        yield EVENT
        yield DONE


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
@serve.ingress(chain_api)
class FloorIngress:
    """Stands where ChatAPI stands: parses the body, calls the replica, relays its stream."""

    def __init__(self, replica: DeploymentHandle) -> None:
        self.replica = replica

    @chain_api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> StreamingResponse:
        events = self.replica.options(stream=True).chat_stream.remote(await request.json())
        first = await events.__anext__()

        async def relay() -> AsyncIterator[str]:
            yield first
            async for event in events:
                yield event

        return StreamingResponse(relay(), media_type="text/event-stream")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
@serve.ingress(direct_api)
class FloorDirect:
    """One deployment answering the stream itself (Serve's own floor)."""

    @direct_api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> StreamingResponse:
        await request.json()
        return one_event_stream()

    def record_replica_metadata(self) -> dict[str, Any]:
        """Shard 0 of 1, as an LLM replica publishes it (read only behind UserShardRouter)."""
        return replica_metadata(0, 1)


class NoopReplica:
    """Stands where MemoryLLM stands behind ChatRoutes: a chat streams one event and [DONE]."""

    async def chat_stream(self, request: Any, cache_scope: str | None = None) -> AsyncIterator[str]:
        yield EVENT
        yield DONE


class FloorRoutes(ChatRoutes):
    """The service's HTTP routes (serve_app.ingress.routes.ChatRoutes) in front of a NoopReplica."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.num_shards, self.ingress_name = 1, "floor-routes"
        self._init_routes(settings)
        self._local = LocalCalls(NoopReplica())

    def _replica(self, shard: int, avoid: str | None = None) -> Any:
        return self._local

    def _home_replica(self) -> Any:
        return self._local

    def record_replica_metadata(self) -> dict[str, Any]:
        return replica_metadata(0, 1)


def floor_routes_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Builder of FloorRoutes, with the service's `args` (its Redis, its auth mode)."""
    deployment = serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)(serve.ingress(api)(FloorRoutes))
    return deployment.options(
        name="FloorRoutes", request_router_config=RequestRouterConfig(request_router_class=UserShardRouter)
    ).bind(ServiceSettings.from_args(args))


floor_chain = FloorIngress.bind(FloorReplica.bind())
floor_direct = FloorDirect.bind()
floor_direct_routed = FloorDirect.options(
    name="FloorDirectRouted", request_router_config=RequestRouterConfig(request_router_class=UserShardRouter)
).bind()
