"""ChatAPI: the router deployment (`routing: router`, the default), in front of one LLMReplica
deployment per shard. It serves every HTTP route (serve_app.ingress.routes and the Mem0 platform's,
serve_app.ingress.mem0_routes, text completions: serve_app.ingress.completion_routes) and sends each user to the replica holding that user's memory."""

from __future__ import annotations

from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.ingress.completion_routes import CompletionRoutes
from serve_app.ingress.mem0_routes import Mem0Routes
from serve_app.ingress.routes import api
from serve_app.settings import ServiceSettings


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
@serve.ingress(api)
class ChatAPI(Mem0Routes, CompletionRoutes):
    """user -> shard (assigned once, kept in Redis, cached here) -> the handle of that shard's
    LLMReplica deployment."""

    def __init__(self, replicas: list[DeploymentHandle], settings: ServiceSettings) -> None:
        self.replicas = replicas
        self.num_shards = len(replicas)
        self.ingress_name = "router"
        self._init_routes(settings)

    def _replica(self, shard: int) -> DeploymentHandle:
        return self.replicas[shard]

    def _home_replica(self) -> DeploymentHandle:
        return self.replicas[0]
