"""WebhookStore: the webhooks keys registered (Mem0's webhooks), in Redis next to the memories they report on.

A webhook belongs to the API key that created it (its `project`, as GET /v1/ping/ names the key's
project to Mem0's client) and reports events of the users that key acts for (`users`, copied from
the key when created; None: an admin key, every user). It lives as long as Redis keeps the memories:

    P:webhook:{id}              JSON: webhook_id, name, url, event_types, project, users, secret,
                                is_active, created_at, updated_at
    P:webhooks:project:{key}    set of the key's webhook ids
    P:webhooks:all              set of every webhook id (matching an event to its webhooks)

Reads and writes use redis.asyncio with short socket timeouts; Redis errors arrive as
StoreUnavailable (memory.directory.redis_unavailable), so the ingress needs no redis-py.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import redis.asyncio as aioredis

from memory.directory import redis_unavailable

WEBHOOK_ID_PATTERN = r"^wh_[0-9a-f]{24}$"


def new_webhook_id() -> str:
    return f"wh_{secrets.token_hex(12)}"


def new_webhook_secret() -> str:
    """The HMAC-SHA256 key a receiver checks deliveries with (given once, at create)."""
    return f"whsec_{secrets.token_hex(32)}"


class WebhookLimit(Exception):
    """The key already has its most webhooks (webhooks.max_per_key)."""


class WebhookStore:
    """See the module docstring."""

    def __init__(self, client: aioredis.Redis, prefix: str = "kvmem", max_per_key: int = 20) -> None:
        self.r = client
        self.prefix = prefix
        self.max_per_key = max_per_key

    @classmethod
    def from_url(cls, url: str, prefix: str, max_per_key: int, timeout_s: float = 1.0, password: str | None = None) -> "WebhookStore":
        client = aioredis.Redis.from_url(url, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, prefix, max_per_key)

    def _webhook(self, webhook_id: str) -> str:
        return f"{self.prefix}:webhook:{webhook_id}"

    def _of_project(self, key_id: str) -> str:
        return f"{self.prefix}:webhooks:project:{key_id}"

    def _all(self) -> str:
        return f"{self.prefix}:webhooks:all"

    @redis_unavailable("webhook store")
    async def create(self, project: str, users: list[str] | None, name: str, url: str, event_types: list[str]) -> dict[str, Any]:
        """A new webhook of key `project` (WebhookLimit past max_per_key); its record, secret included."""
        if await self.r.scard(self._of_project(project)) >= self.max_per_key:
            raise WebhookLimit(f"this key has {self.max_per_key} webhooks already (webhooks.max_per_key); delete one first")
        now = time.time()
        record = {
            "webhook_id": new_webhook_id(), "name": name, "url": url, "event_types": event_types, "project": project,
            "users": users, "secret": new_webhook_secret(), "is_active": True, "created_at": now, "updated_at": now,
        }
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.set(self._webhook(record["webhook_id"]), json.dumps(record))
            pipe.sadd(self._of_project(project), record["webhook_id"])
            pipe.sadd(self._all(), record["webhook_id"])
            await pipe.execute()
        return record

    @redis_unavailable("webhook store")
    async def get(self, webhook_id: str) -> dict[str, Any] | None:
        raw = await self.r.get(self._webhook(webhook_id))
        return None if raw is None else json.loads(raw)

    async def _records(self, ids: list[str]) -> list[dict[str, Any]]:
        if not ids:
            return []
        raws = await self.r.mget([self._webhook(i) for i in ids])
        return sorted((json.loads(raw) for raw in raws if raw is not None), key=lambda r: (r["created_at"], r["webhook_id"]))

    @redis_unavailable("webhook store")
    async def of_project(self, project: str) -> list[dict[str, Any]]:
        """The key's webhooks, oldest first."""
        return await self._records([m.decode() for m in await self.r.smembers(self._of_project(project))])

    @redis_unavailable("webhook store")
    async def every(self) -> list[dict[str, Any]]:
        """Every webhook (for matching events to them)."""
        return await self._records([m.decode() for m in await self.r.smembers(self._all())])

    @redis_unavailable("webhook store")
    async def update(self, webhook_id: str, changes: dict[str, Any]) -> dict[str, Any] | None:
        """The webhook with `changes` (name, url, event_types, is_active) applied; None if it is gone."""
        key = self._webhook(webhook_id)
        async with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        return None
                    record = {**json.loads(raw), **changes, "updated_at": time.time()}
                    pipe.multi()
                    pipe.set(key, json.dumps(record))
                    await pipe.execute()
                    return record
                except aioredis.WatchError:
                    continue

    @redis_unavailable("webhook store")
    async def delete(self, webhook_id: str, project: str) -> bool:
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.delete(self._webhook(webhook_id))
            pipe.srem(self._of_project(project), webhook_id)
            pipe.srem(self._all(), webhook_id)
            deleted, *_ = await pipe.execute()
        return bool(deleted)

    async def close(self) -> None:
        await self.r.aclose()
