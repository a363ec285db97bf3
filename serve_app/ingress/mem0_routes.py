"""The Mem0 platform's routes, so the official `mem0ai` client works against this service.

`MemoryClient(api_key=..., host=...)` pings, then calls these (its other calls reach this
service's own routes, which answer at their trailing-slash paths too: serve_app.ingress.routes):
    GET    /v1/ping/                     the key is valid (`Authorization: Token <key>`, or Bearer)
    POST   /v3/memories/add/             add: messages, user_id, metadata, infer
    POST   /v3/memories/?page=&page_size= get_all: {"filters": {"user_id": ...}}, paginated
    POST   /v3/memories/search/          search: query, filters, top_k, threshold
Bodies are Mem0's (serve_app.memory_protocol); each becomes the same call as this service's own
route, with the same checks: the key acts only for its users, and bad input gets a 400 naming it.
Each answers with and without its trailing slash (no redirect); a page's `next` and `previous`
are relative links, or on `public_base_url`, never built from the request's Host header.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar
from urllib.parse import urlencode

from fastapi import Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from serve_app.ingress.auth import Principal, caller
from serve_app.ingress.routes import ChatRoutes, api
from serve_app.ingress.strict_routes import register
from serve_app.memory_protocol import Mem0AddRequest, Mem0ListRequest, Mem0SearchRequest, MemoryItem, MemorySearchHit

MAX_PAGE_SIZE = 1_000
T = TypeVar("T")


def translated(make: Callable[[], T]) -> T:
    """This service's request for a Mem0 one; a bound it breaks is a 400, as for a body FastAPI parsed."""
    try:
        return make()
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc


class Mem0Routes(ChatRoutes):
    """ChatRoutes plus the Mem0 platform's routes (module docstring)."""

    @register(api, "GET", "/v1/ping/")
    async def mem0_ping(self, principal: Principal = Depends(caller)) -> dict[str, Any]:
        """The key is valid (the RequestGate checked it). The client needs an organisation and a
        project: here the service's namespace and the key's id (a key names its users itself)."""
        return {"status": "ok", "org_id": self.settings.namespace, "project_id": principal.key_id, "user_email": None}

    @register(api, "POST", "/v3/memories/add/")
    async def mem0_add(self, request: Mem0AddRequest, principal: Principal = Depends(caller)) -> dict[str, Any]:
        return await self.add_memories(translated(request.as_add), principal)

    @register(api, "POST", "/v3/memories/")
    async def mem0_get_all(
        self, request: Mem0ListRequest, http: Request,
        page: int = Query(1, ge=1), page_size: int = Query(100, ge=1, le=MAX_PAGE_SIZE),
        principal: Principal = Depends(caller),
    ) -> dict[str, Any]:
        """Mem0's page of the user's memories, oldest first: count, next, previous (URLs) and results."""
        memories: list[MemoryItem] = await self._memories_of(principal, request.filters.user_id)
        memories.sort(key=lambda m: (m.created_at, m.id))
        first = (page - 1) * page_size

        def page_url(number: int) -> str:
            """Relative, or on public_base_url: never on the request's Host header (a forged Host
            would send a client that follows `next` elsewhere, with its key)."""
            base = (self.settings.public_base_url or "").rstrip("/") or http.scope.get("root_path", "")
            return f"{base}/v3/memories/?{urlencode({'page': number, 'page_size': page_size})}"

        return {
            "count": len(memories),
            "next": page_url(page + 1) if first + page_size < len(memories) else None,
            "previous": page_url(page - 1) if page > 1 else None,
            "results": memories[first : first + page_size],
        }

    @register(api, "POST", "/v3/memories/search/")
    async def mem0_search(self, request: Mem0SearchRequest, principal: Principal = Depends(caller)) -> dict[str, list[MemorySearchHit]]:
        return await self.search_memories(translated(request.as_search), principal)
