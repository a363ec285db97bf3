"""AdminRoutes: the admin's routes (ChatRoutes plus /v1/shards and the API keys under /v1/admin/keys),
for whichever deployment is the ingress. Every route needs an admin key (Authenticator.require_admin)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Depends, HTTPException

from serve_app.ingress.auth import KeyRecord, NewKeyRequest, Principal, caller
from serve_app.ingress.routes import ChatRoutes, api


class AdminRoutes(ChatRoutes):
    """ChatRoutes plus the admin's routes (module docstring)."""

    @api.get("/v1/shards")
    async def shard_stats(self, principal: Principal = Depends(caller)) -> dict[str, Any]:
        self.auth.require_admin(principal)
        limit = self.settings.status_timeout_s + 0.1  # the replica answers from its last statistics after status_timeout_s

        async def one(shard: int) -> dict[str, Any]:
            try:
                return await asyncio.wait_for(self._replica(shard).stats.remote(), limit)
            except asyncio.TimeoutError:
                return {"shard": shard, "unavailable": f"the replica did not answer within {limit:g} s (busy, or restarting)"}
            except Exception as exc:  # noqa: BLE001 - a replica being replaced: reported, not a 500
                return {"shard": shard, "unavailable": f"{type(exc).__name__}: {exc}"[:300]}

        return {"results": list(await asyncio.gather(*(one(shard) for shard in range(self.num_shards))))}

    @api.post("/v1/admin/keys")
    async def create_key(
        self, request: NewKeyRequest, principal: Principal = Depends(caller)
    ) -> dict[str, Any]:
        """A new API key; the key itself is in this answer only (Redis keeps its hash)."""
        self.auth.require_admin(principal)
        key, record = await self.keys.create(request.users or (), admin=request.admin, label=request.label)
        return {"key": key, **record.model_dump()}

    @api.get("/v1/admin/keys")
    async def list_keys(self, principal: Principal = Depends(caller)) -> dict[str, list[KeyRecord]]:
        self.auth.require_admin(principal)
        return {"results": await self.keys.list()}

    @api.delete("/v1/admin/keys/{key_id}")
    async def revoke_key(self, key_id: str, principal: Principal = Depends(caller)) -> dict[str, Any]:
        self.auth.require_admin(principal)
        if not await self.keys.revoke(key_id):
            raise HTTPException(404, f"no API key {key_id!r}")
        return {"message": f"API key {key_id} revoked"}
