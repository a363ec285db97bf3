"""The floor of Ray Serve itself: no-op applications with the service's hop structure.

bench/serve_h200.py deploys these next to the real application (same Ray cluster, same HTTP
proxy) and times the first streamed byte through them, so "the service's own overhead" is
measured against what Serve costs with no work at all:

- `floor_chain` (route /floor): proxy -> FastAPI ingress deployment -> DeploymentHandle
  (stream=True) -> a replica deployment that yields one server-sent event and [DONE]; the
  ingress awaits the first event before it answers, as serve_app.ingress.ChatAPI does.
- `floor_direct` (route /floor-direct): proxy -> one deployment that streams the same events.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

EVENT = 'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":"ok"}}]}\n\n'
DONE = "data: [DONE]\n\n"

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

        async def events() -> AsyncIterator[str]:
            yield EVENT
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream")


floor_chain = FloorIngress.bind(FloorReplica.bind())
floor_direct = FloorDirect.bind()
