"""OpenAI's model and embeddings routes (OpenAIRoutes), for whichever deployment is the ingress.

    GET  /v1/models              the chat model and the embedding model
    GET  /v1/models/{id}         one of them; any other id: 404 `model_not_found`
    POST /v1/embeddings          the memory's query embedder (serve_app.embeddings_protocol; the
                                 replica's side: serve_app.replica.query_embeddings)

Embeddings touch no user's memory: they run on the home replica, and count against the caller's
key like chats (serve_app.ingress.admission). A request naming a `user` needs a key that may act
for that user (403) and spends that user's chat rate.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import Depends, HTTPException
from pydantic import BaseModel

from serve_app.embeddings_protocol import EmbeddingRequest, EmbeddingResponse
from serve_app.ingress.auth import Principal, caller
from serve_app.ingress.routes import ChatRoutes, api
from serve_app.protocol import NotFound

OWNER = "kv-memory-serve"
_STARTED = int(time.time())  # `created` of the models: when this ingress started serving them


class ModelCard(BaseModel):
    """OpenAI's model object."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = OWNER


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIRoutes(ChatRoutes):
    """ChatRoutes plus the model and embeddings routes (module docstring)."""

    def _model_cards(self) -> list[ModelCard]:
        names = dict.fromkeys([self.settings.served_model_name, self.settings.embedding_model_name])  # the chat model first
        return [ModelCard(id=name, created=_STARTED) for name in names]

    @api.get("/v1/models")
    async def models(self, principal: Principal = Depends(caller)) -> ModelList:
        return ModelList(data=self._model_cards())

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, principal: Principal = Depends(caller)) -> ModelCard:
        for card in self._model_cards():
            if card.id == model_id:
                return card
        message = f"the model {model_id!r} does not exist; this service serves {[c.id for c in self._model_cards()]}"
        raise HTTPException(404, message) from NotFound(message, param="model", code="model_not_found")

    @api.post("/v1/embeddings")
    async def embeddings(self, request: EmbeddingRequest, principal: Principal = Depends(caller)) -> EmbeddingResponse:
        if request.user:
            await self._authorize(principal, request.user, "chats")
        name = self.settings.embedding_model_name
        if request.model is not None and request.model != name:  # answered here: no replica call for it
            message = f"the model {request.model!r} does not exist; this service embeds with {name!r}"
            raise HTTPException(404, message) from NotFound(message, param="model", code="model_not_found")
        answer: Any = await self._answer(self._home_replica().embed.remote(request))
        return answer
