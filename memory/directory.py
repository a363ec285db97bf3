"""UserDirectory: the ingress's async, cached view of where memory lives (user -> shard, fact -> owner).

Both maps only ever grow (a user keeps its shard until its memory is erased; a fact id keeps its
owner forever), so the ingress caches them and the chat path does not touch Redis once a user
is known. Reads use redis.asyncio with short socket timeouts: a Redis outage answers within
about a second instead of blocking the ingress's event loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any, Awaitable, Callable, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, OutOfMemoryError, RedisError, ResponseError

from memory.quota import redis_memory_report
from memory.records import StoreFull, StoreUnavailable, is_fact_id
from memory.redis_keys import RedisKeys, stable_shard

T = TypeVar("T")


def redis_unavailable(what: str) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
    """Decorates an async method: a Redis error becomes StoreUnavailable naming `what`, so the
    ingress handles an outage without importing redis-py."""

    def wrap(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(method)
        async def called(*args: Any, **kwargs: Any) -> T:
            try:
                return await method(*args, **kwargs)
            except AuthenticationError as exc:  # a ConnectionError to redis-py: said apart, it is no outage
                raise StoreUnavailable(
                    f"{what} (Redis) refused this client's password ({exc}): the service needs Redis's requirepass "
                    "as REDIS_PASSWORD"
                ) from exc
            except OutOfMemoryError as exc:  # maxmemory, noeviction: the write was refused, nothing changed
                raise StoreFull(f"the {what} (Redis) is full and refused the write: {exc}") from exc
            except RedisError as exc:
                raise StoreUnavailable(f"{what} (Redis) unavailable: {exc}") from exc

        return called

    return wrap

_MAX_CACHED = 200_000  # entries per map; cleared whole when full (a re-read is one Redis call)


class UserDirectory:
    def __init__(self, client: aioredis.Redis, prefix: str = "kvmem") -> None:
        self.r = client
        self.keys = RedisKeys(prefix)
        self._shards: dict[str, int] = {}
        self._owners: dict[str, str] = {}

    @classmethod
    def from_url(cls, url: str, prefix: str = "kvmem", timeout_s: float = 1.0, password: str | None = None) -> "UserDirectory":
        """A directory over the Redis at `url` (`password`: its requirepass; one in the URL wins)."""
        client = aioredis.Redis.from_url(url, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, prefix)

    def cached_shard(self, user_id: str) -> int | None:
        return self._shards.get(user_id)

    @redis_unavailable("memory store")
    async def shard_of(self, user_id: str, num_shards: int) -> int:
        """The user's shard: read back once assigned, else assigned now by a stable hash."""
        cached = self._shards.get(user_id)
        if cached is not None:
            return cached
        key = self.keys.user(user_id, "shard")
        current = await self.r.get(key)
        if current is None:
            shard = stable_shard(user_id, num_shards)
            if await self.r.set(key, shard, nx=True):
                await self.r.sadd(self.keys.shard_users(shard), user_id)
            current = await self.r.get(key)
        shard = int(current if current is not None else stable_shard(user_id, num_shards))
        self._remember(self._shards, user_id, shard)
        return shard

    @redis_unavailable("memory store")
    async def owner_of_fact(self, fact_id: str) -> str | None:
        """The fact's owner, or None for anything that is not a fact: an id of another shape is
        not looked up, and a key of another type (WRONGTYPE) is no fact either, never an error."""
        if not is_fact_id(fact_id):
            return None
        cached = self._owners.get(fact_id)
        if cached is not None:
            return cached
        try:
            raw = await self.r.hget(self.keys.fact(fact_id), "user_id")
        except ResponseError as exc:
            if str(exc).startswith("WRONGTYPE"):
                return None
            raise
        if raw is None:
            return None
        owner = json.loads(raw)
        self._remember(self._owners, fact_id, owner)
        return owner

    @redis_unavailable("memory store")
    async def users(self, num_shards: int, limit: int) -> list[str] | None:
        """Every user placed on a shard, sorted; None when there are more than `limit`."""
        found: set[str] = set()
        for shard in range(num_shards):
            if await self.r.scard(self.keys.shard_users(shard)) + len(found) > limit:
                return None
            found |= {member.decode() for member in await self.r.smembers(self.keys.shard_users(shard))}
        return sorted(found)

    def forget_user(self, user_id: str) -> None:
        """After the user's memory was erased (its placement is gone from Redis too)."""
        self._shards.pop(user_id, None)

    @redis_unavailable("memory store")
    async def ping(self) -> None:
        await self.r.ping()

    async def memory_report(self, warn_fraction: float, timeout_s: float) -> dict[str, Any]:
        """Redis's used memory against its maxmemory (memory.quota.redis_memory_report: a `warning`
        past `warn_fraction`), or why it is unknown; never raises (for /health)."""
        try:
            info = await asyncio.wait_for(self.r.info("memory"), timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported, never raised
            return {"unavailable": f"{type(exc).__name__}: {exc}"[:200]}
        return redis_memory_report(int(info["used_memory"]), int(info.get("maxmemory", 0)), warn_fraction)

    async def close(self) -> None:
        await self.r.aclose()

    @staticmethod
    def _remember(cache: dict, key: str, value: object) -> None:
        if len(cache) >= _MAX_CACHED:
            cache.clear()
        cache[key] = value
