"""The application builder `serve run config.yaml` imports: `serve_app.app:build_app`.

Thin and keyword-only, like Ray Serve LLM's builders: settings in, a bound application out:
with `routing: router` one ChatAPI ingress in front of one LLMReplica deployment per shard; with
`routing: direct` one deployment of LLM replicas that are their own ingress (serve_app.direct_ingress).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from serve_app.card_plan import preflight, replica_actor_options
from serve_app.ingress.router import ChatAPI
from serve_app.ingress.shard_router import UserShardRouter
from serve_app.direct_ingress import direct_deployment
from serve_app.replica.engine import check_engine_kwargs
from serve_app.replica.server import LLMReplica
from serve_app.settings import ServiceSettings


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Application builder for `serve run` (args: the YAML `args`, see ServiceSettings).

    Validates before anything is deployed: an unknown or misspelt key at any level of `args`
    raises pydantic's ValidationError naming it; an engine_kwargs name vLLM does not know raises
    UnknownEngineArgument (a ValueError); where this machine has GPUs (or gpu.card_gib states one),
    a memory plan that does not fit the card raises PlanRefused (a ValueError) naming the numbers
    and the settings to change (serve_app.card_plan.preflight)."""
    settings = ServiceSettings.from_args(args)
    check_engine_kwargs(settings.engine)
    preflight(settings)
    if not settings.redis_url:
        raise ValueError("redis_url (or REDIS_URL) is required: Redis holds the memory records and the user -> shard map")
    if settings.routing == "direct":
        return direct_deployment(settings=settings)
    return ChatAPI.options(num_replicas=settings.ingress_replicas).bind(llm_deployments(settings=settings), settings)


def llm_deployments(*, settings: ServiceSettings) -> list[serve.Application]:
    """One deployment per shard (the router addresses each), of llm_replicas_per_shard replicas."""
    return [
        LLMReplica.options(
            name=f"LLMReplica_{shard}",
            num_replicas=settings.llm_replicas_per_shard,
            # UserShardRouter: a chat passed on from a replica whose engine is down avoids that replica
            request_router_config=RequestRouterConfig(request_router_class=UserShardRouter),
            max_ongoing_requests=settings.llm_replica_max_ongoing_requests,
            max_constructor_retry_count=settings.replica_start_attempts,  # a failed start is reported, not repeated
            ray_actor_options=replica_actor_options(settings),  # with the environment that keeps pools off the card
        ).bind(settings, shard)
        for shard in range(settings.llm_replicas)
    ]
