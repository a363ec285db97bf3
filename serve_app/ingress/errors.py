"""OpenAI-shaped errors for every 4xx/5xx the HTTP API answers, and the OpenAPI schema that says so.

Every error body is `{"error": {"message", "type", "param", "code"}}` (serve_app.protocol.ErrorResponse),
as OpenAI's API and its clients expect (`openai.BadRequestError.param`, `.code`, `.type`):

- request validation (FastAPI's RequestValidationError): 400 as OpenAI and vLLM's server answer
  it (FastAPI's own 422 would reach OpenAI clients as an UnprocessableEntityError no caller of
  that API catches), `param` the dotted field path (`messages.0.content`), `code` pydantic's error
  type; a field this service does not implement is refused by name (`code: unsupported_parameter`);
- HTTPException (the ingress's own refusals, unknown routes, 405): its status; a replica's
  RequestRejected / NotFound behind it lends its `param` and `code` (`model_not_found`); a path
  no route serves is 404 `route_not_found` naming the method and path (never Mem0's "not found"
  of a memory), a wrong method 405 `method_not_allowed`;
- anything else: 500, or 503 when a replica or the memory shard is unavailable or overloaded
  (`http_error` maps a replica's exceptions: refusals, a dead engine, quotas, Redis away or full);
- before any route: 401 without a valid key, 429 `rate_limited` / `too_many_requests_in_flight`
  past a key's or user's admission (with Retry-After), 413 for a body over `max_body_bytes`, 408
  `request_timeout` for a body not in by `body_timeout_s`, 400 `nested_too_deep` past
  `max_json_depth`, answered by serve_app.ingress.gate with these same bodies; 413
  `request_too_large` for an add past `add_limits`;
- 429 `quota_exceeded` (`param` the quota's setting, the message the user's use and limit) for a
  write past a per-user quota, 507 `memory_store_full` with Retry-After when Redis refused a write
  at its maxmemory: in both cases nothing was stored.

`install_error_handlers(api)` registers the handlers and rewrites the app's OpenAPI document so
that every operation documents these statuses with the ErrorResponse schema (and the chat and
text-completion routes their JSON answer and their server-sent events), which the schema-driven
fuzz test holds it to.
Imports neither torch nor vLLM: it runs in the ingress.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, Callable, Sequence

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from memory.fairness import EncodeBacklogFull
from memory.records import QuotaExceeded, StoreFull, StoreUnavailable
from serve_app.completion_protocol import CompletionResponse
from serve_app.embeddings_protocol import EmbedderBusy
from serve_app.protocol import ChatCompletionChunk, ChatCompletionResponse, EngineUnavailable, ErrorResponse, NotFound, RequestRejected

logger = logging.getLogger(__name__)

ERROR_STATUSES = (400, 401, 403, 404, 405, 408, 413, 429, 500, 503, 504, 507)
_TYPE_OF_STATUS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}
# Ray's signs that a replica or actor is gone or full: the service is unavailable, not broken.
_UNAVAILABLE = {
    "BackPressureError", "DeploymentUnavailableError", "ReplicaUnavailableError", "ActorDiedError",
    "ActorUnavailableError", "RayActorError", "ShardTimeout",
}
# memory.records and memory.fairness: 429 and 507, their `code` and `param` kept
_REFUSALS_WITH_A_CODE = {"QuotaExceeded", "StoreFull", "EncodeBacklogFull", "Refused"}  # Refused: serve_app.ingress.admission
_CODE_OF_STATUS = {401: "invalid_api_key"}
UNAVAILABLE_RETRY_AFTER_S = "5"  # as for a Redis outage (routes.http_error): a restarted replica or shard is back within seconds
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def error_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return _TYPE_OF_STATUS.get(status, "invalid_request_error")


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = ErrorResponse(error={"message": message, "type": error_type(status), "param": param, "code": code})
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _param(loc: Sequence[Any]) -> str | None:
    """`("body", "messages", 0, "content", "str")` -> `messages.0.content` (union member tags dropped)."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p or "-" in p))]
    if parts and parts[0] in {"body", "query", "path", "header", "cookie"}:
        parts = parts[1:]
    return ".".join(parts) or None


def _describe(error: dict[str, Any]) -> tuple[str, str | None, str]:
    param = _param(error.get("loc", ()))
    kind = str(error.get("type", "invalid"))
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({error.get('ctx', {}).get('error', 'decode error')})", None, kind
    if kind == "extra_forbidden":  # the client's own key: keep it whole
        loc = [str(p) for p in error.get("loc", ())]
        param = ".".join(loc[1:] if loc and loc[0] in {"body", "query"} else loc) or None
        return f"unsupported parameter: {param!r} is not supported by this service", param, "unsupported_parameter"
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    names_itself = kind == "value_error" and param is not None and param.rsplit(".", 1)[-1] in message
    return (f"{param}: {message}" if param and not names_itself else message), param, kind


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    # A union reports one error per member: the members a value is not even the type of say least.
    fitting = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    errors = fitting or errors
    errors.sort(key=lambda e: (e.get("type") != "value_error", e.get("type") != "extra_forbidden"))
    described = [_describe(e) for e in errors] or [("invalid request", None, "invalid")]
    message = "; ".join(dict.fromkeys(m for m, _, _ in described))
    _, param, code = described[0]
    return error_response(400, message[:2000], param, code)


def _origin(exc: BaseException) -> BaseException | None:
    """The service's own exception behind an HTTP error or Ray's wrapper, if there is one."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        cause = getattr(seen, "cause", None) or seen
        if isinstance(cause, (RequestRejected, NotFound)) or type(cause).__name__ in _UNAVAILABLE | _REFUSALS_WITH_A_CODE:
            return cause
        seen = seen.__cause__
    return None


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    origin = _origin(exc.__cause__) if exc.__cause__ is not None else None
    param = getattr(origin, "param", None)
    code = getattr(origin, "code", None) or _CODE_OF_STATUS.get(exc.status_code)
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404 and message == "Not Found" and origin is None:  # Starlette's: no route matched
        message, code = f"no route {request.method} {request.url.path}", "route_not_found"
    elif exc.status_code == 405:
        message, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
    return error_response(exc.status_code, message, param, code, headers=dict(exc.headers or {}) or None)


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    origin = _origin(exc)
    if origin is not None and not isinstance(origin, (RequestRejected, NotFound)):
        logger.warning("%s %s: unavailable: %r", request.method, request.url.path, origin)
        return error_response(
            503, f"the service is unavailable right now ({type(origin).__name__}); retry later", headers={"Retry-After": UNAVAILABLE_RETRY_AFTER_S}
        )
    if isinstance(origin, RequestRejected):
        return error_response(400, str(origin.args[0]), origin.param, origin.code)
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal error ({type(exc).__name__}); the request may be retried")


# ---------------------------------------------------------------------------------------- OpenAPI
def _sse_event(chunk_ref: str) -> dict[str, Any]:
    """One server-sent event (OpenAPI before 3.2: the stream's `schema` describes each event): its
    `data` is a chat.completion.chunk as JSON, or `[DONE]` at the end."""
    chunk = {"contentMediaType": "application/json", "contentSchema": {"$ref": chunk_ref}}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string", "anyOf": [{"const": "[DONE]"}, chunk]}, "event": {"type": "string"}},
    }


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": ref}}}


def document_responses(schema: dict[str, Any]) -> dict[str, Any]:
    """Every operation's error statuses (ErrorResponse), and the two answer forms of the chat and text-completion routes."""
    refs, definitions = models_json_schema(
        [(ErrorResponse, "serialization"), (ChatCompletionResponse, "serialization"), (ChatCompletionChunk, "serialization"),
         (CompletionResponse, "serialization")],
        ref_template="#/components/schemas/{model}",
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in definitions.get("$defs", {}).items():
        if components.setdefault(name, definition) != definition:
            raise RuntimeError(f"OpenAPI component {name!r} is defined twice, differently")
    error_ref = refs[(ErrorResponse, "serialization")]["$ref"]
    chat_ref = refs[(ChatCompletionResponse, "serialization")]["$ref"]
    chunk_ref = refs[(ChatCompletionChunk, "serialization")]["$ref"]
    completion_ref = refs[(CompletionResponse, "serialization")]["$ref"]  # its stream's events are the same model
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)  # FastAPI's validation answer: a 400 here
            for status in ERROR_STATUSES:
                responses[str(status)] = {"description": HTTPStatus(status).phrase, "content": _json(error_ref)}
            if path == "/v1/chat/completions" and method == "post":
                responses["200"] = {
                    "description": "A chat.completion, or with stream=true server-sent chat.completion.chunk events.",
                    "content": {**_json(chat_ref), "text/event-stream": {"schema": _sse_event(chunk_ref)}},
                }
            if path == "/v1/completions" and method == "post":
                responses["200"] = {
                    "description": "A text_completion, or with stream=true server-sent text_completion events.",
                    "content": {**_json(completion_ref), "text/event-stream": {"schema": _sse_event(completion_ref)}},
                }
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return schema


# ---------------------------------------------------------------------- a replica's exceptions as HTTP errors
def http_error(exc: BaseException) -> HTTPException | None:
    """The HTTP error for a replica's exception (Ray wraps it; report the original message)."""
    cause = getattr(exc, "cause", None) or exc
    message = cause.message if isinstance(cause, QuotaExceeded) else str(cause.args[0] if cause.args else cause)
    if isinstance(cause, RequestRejected):
        return HTTPException(status_code=400, detail=message)
    if isinstance(cause, NotFound):
        return HTTPException(status_code=404, detail=message)
    if isinstance(cause, EngineUnavailable):  # the replica's engine is down (a chat may go to another replica)
        return HTTPException(503, f"the engine is restarting, try again shortly ({message})", {"Retry-After": "5"})
    if type(cause).__name__ in _ENGINE_DOWN:  # by name: the ingress does not import vLLM
        return HTTPException(503, f"the engine is restarting, try again shortly ({message})", {"Retry-After": "5"})
    if isinstance(cause, QuotaExceeded):  # nothing stored; deletes free quota
        return HTTPException(status_code=429, detail=message)
    if isinstance(cause, StoreFull):  # Redis at maxmemory (noeviction) refused the write: nothing changed
        return HTTPException(507, message, {"Retry-After": "60"})
    if isinstance(cause, EncodeBacklogFull):  # the user's facts waiting for KV are at the bound: nothing stored
        return HTTPException(429, message, {"Retry-After": str(cause.retry_after_s)})
    if isinstance(cause, StoreUnavailable):  # Redis away: nothing was acknowledged, try again
        return HTTPException(503, message, {"Retry-After": "5"})
    if isinstance(cause, EmbedderBusy):  # the replica's embedder is busy with other requests (or still loading)
        return HTTPException(503, message, {"Retry-After": "5"})
    if isinstance(cause, TimeoutError):  # the memory shard did not answer in time (busy, or restarting)
        return HTTPException(503, f"the memory shard is busy or restarting, try again shortly ({message})", {"Retry-After": "5"})
    return None


# vLLM's errors for a dead engine (vllm.v1.engine.exceptions); the replica restarts it in place
_ENGINE_DOWN = {"EngineDeadError", "EngineGenerateError"}


def store_unavailable(exc: StoreUnavailable) -> HTTPException:
    """503 with Retry-After; 507 when Redis is full (StoreFull)."""
    return http_error(exc) or HTTPException(status_code=503, detail=str(exc), headers={"Retry-After": "5"})


def install_error_handlers(api: FastAPI) -> None:
    """Register the OpenAI-shaped handlers on `api` and document them in its OpenAPI schema."""
    api.add_exception_handler(RequestValidationError, _validation_error)
    api.add_exception_handler(StarletteHTTPException, _http_error)
    api.add_exception_handler(Exception, _server_error)
    build: Callable[[], dict[str, Any]] = api.openapi

    def openapi() -> dict[str, Any]:
        if api.openapi_schema is None:
            api.openapi_schema = document_responses(build())
        return api.openapi_schema

    api.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the schema
