"""ReplicaIngress: the `routing: direct` topology, where each LLM replica is its own HTTP ingress.

Serve's proxy hands an HTTP request straight to an LLM replica, chosen by UserShardRouter
(serve_app.ingress.shard_router) from the `x-session-id` header (the user id): one Serve hop instead of
two (proxy -> ChatAPI -> LLMReplica). The replica runs the same routes as ChatAPI
(serve_app.ingress.routes, serve_app.ingress.mem0_routes): keys, ownership checks and the user -> shard map from Redis.
A request for its own shard runs in process; one for another shard (no header, or a user placed
before the shard count changed) is forwarded through a handle to this deployment with the hint
`shard:<n>`, which the router sends only to that shard's replicas. A replica whose engine died,
with other replicas of its shard running, passes its own shard's calls to them the same way
(`shard:<n>:avoid:<itself>`) until Serve replaces it.

The deployment runs llm_replicas x llm_replicas_per_shard replicas. A replica's Serve rank r
below that count gives its shard (r mod llm_replicas); a replica that replaces one Serve stopped
for failing its health check starts while the old one still holds its rank, so it gets a rank
past the count: it takes the shard that has fewer live engines than llm_replicas_per_shard
(shard_short_of_engines; the replica it replaces gave its engine slot up). The shard is published
to the routers through Serve's record_replica_metadata hook; with several replicas per shard
UserShardRouter sends a user's request to any of them.

It composes the ingress (serve_app.ingress) with the replica (serve_app.replica), so it sits above
both, beside the builder (serve_app.app): the replica itself imports nothing of the ingress.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from ray import serve
from ray.serve.config import RequestRouterConfig

from kvarena.arena import ArenaError, FactArena
from serve_app.card_plan import replica_actor_options
from serve_app.ingress.admin_routes import AdminRoutes
from serve_app.ingress.completion_routes import CompletionRoutes
from serve_app.ingress import mem0_unimplemented  # noqa: F401 - registers the Mem0 routes answered 501
from serve_app.ingress.mem0_routes import Mem0Routes
from serve_app.ingress.openai_routes import OpenAIRoutes
from serve_app.ingress.responses_routes import ResponsesRoutes
from serve_app.ingress.webhook_routes import WebhookRoutes
from serve_app.ingress.routes import api
from serve_app.replica.lifecycle import engine_dead
from serve_app.replica.server import MemoryLLM
from serve_app.settings import ServiceSettings
from serve_app.ingress.shard_availability import ShardAvailability
from serve_app.ingress.shard_router import UserShardRouter
from serve_app.shard_routing import shard_hint


class _LocalStream:
    """An async generator of this process behind the shape of a streaming Serve response."""

    def __init__(self, events: AsyncIterator[Any]) -> None:
        self._events = events

    def __aiter__(self) -> "_LocalStream":
        return self

    async def __anext__(self) -> Any:
        return await self._events.__anext__()

    def cancel(self) -> None:
        close = getattr(self._events, "aclose", None)
        if close is not None:
            asyncio.get_running_loop().create_task(close())


class _LocalMethod:
    def __init__(self, method: Any, stream: bool) -> None:
        self._method = method
        self._stream = stream

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        result = self._method(*args, **kwargs)
        return _LocalStream(result) if self._stream else result


class LocalCalls:
    """This replica's own methods, called the way ChatRoutes calls a handle
    (`x.method.remote(...)`, `x.options(stream=True).method.remote(...)`), without a Serve hop."""

    def __init__(self, target: MemoryLLM, stream: bool = False) -> None:
        self._target = target
        self._stream = stream

    def options(self, *, stream: bool = False) -> "LocalCalls":
        return LocalCalls(self._target, stream)

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._target, name), self._stream)


class ReplicaIngress(Mem0Routes, WebhookRoutes, CompletionRoutes, OpenAIRoutes, ResponsesRoutes, AdminRoutes, MemoryLLM):
    """An LLM replica that is its own HTTP ingress (see the module docstring)."""

    def __init__(self, settings: ServiceSettings) -> None:
        context = serve.get_replica_context()
        rank, shards = context.rank.rank, settings.llm_replicas
        shard = rank % shards if rank < shards * settings.llm_replicas_per_shard else shard_short_of_engines(settings)
        MemoryLLM.__init__(self, settings, shard)
        self.num_shards = settings.llm_replicas
        self.ingress_name = f"shard-{shard}"
        self._init_routes(settings)
        self._local = LocalCalls(self)
        self._peers = serve.get_deployment_handle(context.deployment, app_name=context.app_name)
        self.availability = ShardAvailability([self._peers])  # the deployment's RUNNING replicas, for /health

    def _replica(self, shard: int, avoid: str | None = None) -> Any:
        if shard == self.shard_id and avoid != self.replica_id:
            if not (self.settings.llm_replicas_per_shard > 1 and engine_dead(self.engine)):
                return self._local
            avoid = self.replica_id  # its engine is down: the shard's other replicas answer
        return self._peers.options(session_id=shard_hint(shard, avoid))

    def _replicas_running(self) -> int | None:
        self.availability.ensure_polling()
        return self.availability.running_total()

    def _home_replica(self) -> Any:
        return self._local



def shard_short_of_engines(settings: ServiceSettings, wait_s: float = 120.0) -> int:
    """The first shard whose arena (on this host) has fewer live engines than llm_replicas_per_shard:
    the shard of the replica being replaced. Waits up to `wait_s` for one (the old replica gives its
    slot up when its engine dies, or frees it when its process ends)."""
    deadline = time.monotonic() + wait_s
    while True:
        for shard in range(settings.llm_replicas):
            try:
                arena = FactArena.open(settings.memory.arena_path(settings.namespace, shard))
            except (ArenaError, OSError):
                continue
            try:
                if arena.live_engines() < settings.llm_replicas_per_shard:
                    return shard
            finally:
                arena.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"no shard of this host is short of an engine after {wait_s:.0f} s")
        time.sleep(1.0)


def direct_deployment(*, settings: ServiceSettings) -> serve.Application:
    """llm_replicas x llm_replicas_per_shard replicas of ReplicaIngress, routed by user (UserShardRouter)."""
    deployment = serve.deployment(health_check_period_s=2, health_check_timeout_s=30)(serve.ingress(api)(ReplicaIngress))
    return deployment.options(
        name="LLMReplica",
        num_replicas=settings.llm_replicas * settings.llm_replicas_per_shard,
        max_ongoing_requests=settings.llm_replica_max_ongoing_requests,
        request_router_config=RequestRouterConfig(request_router_class=UserShardRouter),
        max_constructor_retry_count=settings.replica_start_attempts * settings.llm_replicas,  # a failed start is reported
        ray_actor_options=replica_actor_options(settings),  # with the environment that keeps pools off the card
    ).bind(settings)
