"""ChatAPI: the router deployment (`routing: router`, the default), in front of one LLMReplica
deployment per shard. It serves every HTTP route (serve_app.ingress.routes and the Mem0 platform's,
serve_app.ingress.mem0_routes and .mem0_unimplemented, text completions: .completion_routes, models
and embeddings: .openai_routes, the Responses API: .responses_routes) and sends each user to the
replica holding that user's memory."""

from __future__ import annotations

from fastapi import HTTPException
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.ingress.admin_routes import AdminRoutes
from serve_app.ingress.completion_routes import CompletionRoutes
from serve_app.ingress import mem0_unimplemented  # noqa: F401 - registers the Mem0 routes answered 501
from serve_app.ingress.mem0_routes import Mem0Routes
from serve_app.ingress.openai_routes import OpenAIRoutes
from serve_app.ingress.responses_routes import ResponsesRoutes
from serve_app.ingress.webhook_routes import WebhookRoutes
from serve_app.ingress.routes import api
from serve_app.ingress.shard_availability import ShardAvailability
from serve_app.settings import ServiceSettings
from serve_app.shard_routing import shard_hint


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
@serve.ingress(api)
class ChatAPI(Mem0Routes, WebhookRoutes, CompletionRoutes, OpenAIRoutes, ResponsesRoutes, AdminRoutes):
    """user -> shard (assigned once, kept in Redis, cached here) -> the handle of that shard's
    LLMReplica deployment; a shard whose replica Serve is replacing answers 503 at once
    (serve_app.ingress.shard_availability) instead of queueing the request until it is back."""

    def __init__(self, replicas: list[DeploymentHandle], settings: ServiceSettings) -> None:
        self.replicas = replicas
        self.num_shards = len(replicas)
        self.ingress_name = "router"
        self.availability = ShardAvailability(replicas)
        self._init_routes(settings)

    def _replica(self, shard: int, avoid: str | None = None) -> DeploymentHandle:
        return self.replicas[shard].options(session_id=shard_hint(shard, avoid)) if avoid else self.replicas[shard]

    def _shard_refusal(self, shard: int) -> HTTPException | None:
        """503 at once while the shard's deployment has no running replica (Serve is replacing it)."""
        self.availability.ensure_polling()
        return self.availability.refusal(shard)

    def _replicas_running(self) -> int | None:
        self.availability.ensure_polling()
        return self.availability.running_total()

    def _home_replica(self) -> DeploymentHandle:
        """For requests that touch no user's memory: the first shard's replica that is running."""
        self.availability.ensure_polling()
        running = [r for shard, r in enumerate(self.replicas) if self.availability.refusal(shard) is None]
        return running[0] if running else self.replicas[0]
