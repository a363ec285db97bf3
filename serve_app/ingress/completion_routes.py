"""OpenAI's text completions route (POST /v1/completions): a prompt continued as it is, with no
chat template and no memory (serve_app.completion_protocol; the replica's side:
serve_app.replica.text_completions). A request naming a `user` needs a key that may act for that
user, and goes to that user's replica (its prefix cache is there); any other to the home replica.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, HTTPException
from fastapi.responses import StreamingResponse

from serve_app.completion_protocol import CompletionRequest, CompletionResponse
from serve_app.ingress.auth import Principal, caller
from serve_app.ingress.routes import ChatRoutes, api


class CompletionRoutes(ChatRoutes):
    """ChatRoutes plus /v1/completions (module docstring)."""

    @api.post("/v1/completions", response_model=None)
    async def text_completions(
        self, request: CompletionRequest, principal: Principal = Depends(caller)
    ) -> CompletionResponse | StreamingResponse:
        replica: Any = self._home_replica()
        if request.user:
            await self._authorize(principal, request.user, "chats")
            try:
                replica = await self._replica_of_user(request.user)
            except HTTPException:
                pass  # Redis away: the home replica answers (a completion needs no memory)
        scope = None if self.settings.auth.mode == "off" else principal.cache_scope
        if not request.stream:
            return await self._answer(replica.complete.remote(request, scope))
        events = replica.options(stream=True).complete_stream.remote(request, scope)
        first = await self._answer(events.__anext__())  # a refusal comes as a status, not a stream
        return self._relayed(first, events, {})
