"""The Ray Serve application: an HTTP ingress (OpenAI-style API) in front of the LLM replicas.

`serve run config.yaml` imports `serve_app.app:build_app` with the YAML `args`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.protocol import ChatCompletionRequest, ChatCompletionResponse, RequestRejected
from serve_app.settings import ServiceSettings

api = FastAPI(title="kv-memory-serve", description="LLM serving with per-user KV-injected memory.")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
@serve.ingress(api)
class ChatAPI:
    def __init__(self, llm: DeploymentHandle, settings: ServiceSettings) -> None:
        self.llm = llm
        self.settings = settings

    @api.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        if request.stream:
            raise HTTPException(status_code=400, detail="stream=true is not supported yet")
        try:
            return await self.llm.chat.remote(request)
        except RequestRejected as exc:
            # Ray wraps the replica's exception; report the original message, not the trace.
            cause = getattr(exc, "cause", None) or exc
            raise HTTPException(status_code=400, detail=str(cause.args[0] if cause.args else cause)) from exc

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.settings.served_model_name, "object": "model"}]}

    @api.get("/health")
    async def health(self) -> dict[str, Any]:
        status: dict[str, Any] = {"llm": "ok"}
        url = self.settings.redis_url  # REDIS_URL in the environment lands here too
        if url:
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(url, socket_timeout=2)
            try:
                await client.ping()
                status["redis"] = "ok"
            except Exception as exc:  # report, do not crash the ingress
                raise HTTPException(status_code=503, detail=f"redis unreachable: {exc}") from exc
            finally:
                await client.aclose()
        return status


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Application builder for `serve run` (args: the YAML `args`, see ServiceSettings)."""
    settings = ServiceSettings.from_args(args)
    llm = llm_deployment(settings)
    return ChatAPI.bind(llm, settings)


def llm_deployment(settings: ServiceSettings) -> serve.Application:
    """The LLM replicas, sized from settings."""
    from serve_app.llm_replica import LLMReplica

    return LLMReplica.options(
        num_replicas=settings.llm_replicas,
        ray_actor_options={
            "num_cpus": settings.llm_replica_num_cpus,
            "num_gpus": settings.llm_replica_num_gpus,
        },
    ).bind(settings)
