"""OpenAI's Responses API (ResponsesRoutes), for whichever deployment is the ingress.

    POST   /v1/responses          a response: the request as a chat (serve_app.responses_protocol),
                                  run like any chat (its user's replica and memory, its admission:
                                  serve_app.ingress.routes.ChatRoutes._routed_chat); with stream=true
                                  the Responses events (serve_app.ingress.response_events)
    GET    /v1/responses/{id}     a stored response of this key
    DELETE /v1/responses/{id}     deletes it

A response is stored unless the request says `store: false`: its conversation in Redis
(memory.response_store) for `responses.store_ttl_s`, at most `responses.max_stored_per_key` per key,
so `previous_response_id` continues it; only the key that stored it reaches it (another key's id, an
expired one and one never minted are one 404). A continuation naming a user it may not act for is a
403, as any chat. A response whose storing failed (Redis away) is still answered, with `store: false`.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import Depends, HTTPException, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from memory.records import StoreUnavailable
from serve_app.ingress.auth import Principal, caller
from serve_app.ingress.errors import store_unavailable
from serve_app.ingress.response_events import ResponseEvents, response_events
from serve_app.ingress.routes import ChatRoutes, api
from serve_app.protocol import NotFound, RequestRejected
from serve_app.responses_protocol import RESPONSE_ID_PATTERN, DeletedResponse, ResponseObject, ResponsesRequest, new_response_id

logger = logging.getLogger(__name__)


def _refusal(status: int, message: str, param: str | None, code: str | None = None) -> HTTPException:
    """An HTTP error whose body names the field at fault and the code (serve_app.ingress.errors reads
    them off the exception it was raised from)."""
    error = HTTPException(status, message)
    error.__cause__ = (RequestRejected if status == 400 else NotFound)(message, param=param, code=code)
    return error


def _not_found(response_id: str, param: str | None = None) -> HTTPException:
    message = f"no stored response {response_id!r} (never stored, expired, deleted, or not this key's)"
    return _refusal(404, message, param, "response_not_found")


class ResponsesRoutes(ChatRoutes):
    """ChatRoutes plus the Responses API (module docstring)."""

    async def _stored(self, response_id: str, principal: Principal, param: str | None = None) -> dict[str, Any]:
        """The stored record of one of this key's responses (404 otherwise)."""
        if not re.fullmatch(RESPONSE_ID_PATTERN, response_id):
            raise _not_found(response_id, param)  # an id never minted is not looked up
        try:
            record = await self.responses.get(response_id, principal.key_id)
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from exc
        if record is None:
            raise _not_found(response_id, param)
        return record

    @api.post("/v1/responses", response_model=None)
    async def create_response(
        self, request: ResponsesRequest, response: Response, http: Request, principal: Principal = Depends(caller)
    ) -> ResponseObject | StreamingResponse:
        history: list[dict[str, str]] = []
        if request.previous_response_id is not None:
            previous = await self._stored(request.previous_response_id, principal, "previous_response_id")
            if previous.get("user") is not None:
                self.auth.require_user(principal, previous["user"])
            history = previous["conversation"]
        try:
            chat = request.as_chat(history)
        except RequestRejected as exc:
            raise _refusal(400, str(exc), exc.param or "input", exc.code)
        except ValidationError as exc:  # a chat's own checks on the text (e.g. a reserved character sequence)
            message = str(exc.errors()[0].get("msg", exc)).removeprefix("Value error, ")
            raise _refusal(400, f"input: {message}", "input")
        started = ResponseObject.started(new_response_id(), request, self.settings.served_model_name)
        conversation = history + request.input_messages()

        async def keep(final: ResponseObject) -> ResponseObject:
            if not request.stored:
                return final
            said = {"role": "assistant", "content": final.output[0].content[0].text}
            try:
                await self.responses.put(final.id, principal.key_id, request.user, conversation + [said], final.model_dump(mode="json"))
            except StoreUnavailable as exc:  # answered all the same, saying it cannot be continued
                logger.warning("response %s not stored: %s", final.id, exc)
                return final.model_copy(update={"store": False})
            return final

        answer, headers = await self._routed_chat(chat, http, principal)
        if not request.stream:
            choice = answer.choices[0]
            final = started.finished(choice.message.content, choice.finish_reason, answer.usage, answer.memory, answer.timings)
            response.headers.update(headers)
            return await keep(final)
        stream = response_events(ResponseEvents(started), self._relay(*answer), keep)
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)

    @api.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, principal: Principal = Depends(caller)) -> ResponseObject:
        return ResponseObject.model_validate((await self._stored(response_id, principal))["response"])

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, principal: Principal = Depends(caller)) -> DeletedResponse:
        await self._stored(response_id, principal)
        try:
            deleted = await self.responses.delete(response_id, principal.key_id)
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from exc
        if not deleted:
            raise _not_found(response_id)
        return DeletedResponse(id=response_id)
