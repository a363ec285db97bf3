"""The Mem0 platform's routes, so the official `mem0ai` client works against this service.

`MemoryClient(api_key=..., host=...)` pings, then calls these (its other calls reach this
service's own routes, which answer at their trailing-slash paths too: serve_app.ingress.routes):
    GET    /v1/ping/                     the key is valid (`Authorization: Token <key>`, or Bearer)
    POST   /v3/memories/add/             add: messages, user_id, metadata, infer
    POST   /v3/memories/?page=&page_size= get_all: {"filters": ...}, paginated
    POST   /v3/memories/search/          search: query, filters, top_k, threshold
Bodies are Mem0's (serve_app.memory_protocol); each becomes the same calls as this service's own
routes, with the same checks: the key acts only for its users, and bad input gets a 400 naming it.
get_all and search take Mem0's v2 filter trees (serve_app.memory_filters): a tree that names a user
the key may not act for is a 403; one not bounded to named users reads the key's users (an admin
key's: every user, at most MAX_FILTERED_USERS). A search ranks each user's best MAX_SEARCH_RESULTS
hits (top_k when the filter is one user), keeps those the tree selects, merges them by score and
answers the whole memory with its score.
Each answers with and without its trailing slash (no redirect); a page's `next` and `previous`
are relative links, or on `public_base_url`, never built from the request's Host header.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar
from urllib.parse import urlencode

from fastapi import Depends, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from memory.records import StoreUnavailable
from serve_app.ingress.auth import Principal, caller
from serve_app.ingress.errors import store_unavailable
from serve_app.ingress.routes import ChatRoutes, api
from serve_app.ingress.strict_routes import register
from serve_app.memory_filters import Cond, FilterError, Node, matches, parse_filters, reach
from serve_app.memory_protocol import (
    MAX_SEARCH_RESULTS, FilteredSearchHit, Mem0AddRequest, Mem0ListRequest, Mem0SearchRequest, MemoryItem,
)

MAX_PAGE_SIZE = 1_000
MAX_FILTERED_USERS = 1_000  # users an admin's unbounded filter may read in one request
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
        node, users = await self._filtered_users(principal, request.filters)
        memories = [m for user in users for m in await self._memories_of(principal, user) if matches(node, m.model_dump())]
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
    async def mem0_search(self, request: Mem0SearchRequest, principal: Principal = Depends(caller)) -> dict[str, list[FilteredSearchHit]]:
        node, users = await self._filtered_users(principal, request.filters)
        one_user = isinstance(node, Cond) and node.field == "user_id" and node.op == "eq"
        found: list[FilteredSearchHit] = []
        for user in users:
            memories = {m.id: m for m in await self._memories_of(principal, user)}
            replica = await self._replica_of_user(user)
            hits = await self._answer(replica.search.remote(user, request.query, request.top_k if one_user else MAX_SEARCH_RESULTS))
            found += [
                FilteredSearchHit(**memories[h.fact_id].model_dump(), score=h.score)
                for h in hits
                if h.fact_id in memories and matches(node, memories[h.fact_id].model_dump())
                and (request.threshold is None or h.score >= request.threshold)
            ]
        found.sort(key=lambda hit: -hit.score)
        return {"results": found[: request.top_k]}

    async def _filtered_users(self, principal: Principal, filters: dict[str, Any]) -> tuple[Node, list[str]]:
        """A request's filter tree and the users to read for it: 400 for a tree it cannot read, 403 for
        one that names a user the key may not act for (module docstring)."""
        try:
            node = parse_filters(filters)
        except FilterError as exc:
            loc = ("body", *(int(p) if p.isdigit() else p for p in exc.param.split(".")))
            raise RequestValidationError([{"type": "value_error", "loc": loc, "msg": str(exc), "input": None}]) from exc
        named = reach(node)
        if named is not None:
            for user in sorted(named):
                self.auth.require_user(principal, user)
            return node, sorted(named)
        if principal.users is not None:
            return node, sorted(principal.users)
        try:
            every = await self.directory.users(self.num_shards, MAX_FILTERED_USERS)
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from exc
        if every is None:
            raise HTTPException(400, f"this filter reaches more than {MAX_FILTERED_USERS} users: name them (user_id)")
        return node, every
