"""ResponseStore: the Responses API's stored responses in Redis, for `previous_response_id` (the ingress).

A response created with `store` (OpenAI's default) keeps its conversation (its input messages, the
inputs of the responses before it, and its answer; never its `instructions`, which OpenAI does not
carry over either) and the answer as it was sent, so a later request can continue it and GET can
read it back:

    P:response:{id}                  JSON: key_id, user, conversation, response; expires after ttl_s
    P:responses:key:{key_id}         sorted set of the key's stored ids by time: at most max_per_key
                                     (a new one past it drops the oldest)
    P:responses:user:{user}          set of the ids stored for a user (named in the request's `user`),
                                     so erasing a user's memory erases them too (forget_user)

Only the key that stored a response may read, continue or delete it (another key's id is "not
found"). Reads and writes use redis.asyncio with short socket timeouts; Redis errors arrive as
StoreUnavailable (memory.directory.redis_unavailable), so the ingress needs no redis-py.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis.asyncio as aioredis

from memory.directory import redis_unavailable
from memory.redis_keys import RedisKeys


class ResponseStore:
    """See the module docstring."""

    def __init__(self, client: aioredis.Redis, prefix: str = "kvmem", ttl_s: int = 3600, max_per_key: int = 1000) -> None:
        self.r = client
        self.prefix = prefix
        self.keys = RedisKeys(prefix)
        self.ttl_s = ttl_s
        self.max_per_key = max_per_key

    @classmethod
    def from_url(cls, url: str, prefix: str, ttl_s: int, max_per_key: int, timeout_s: float = 1.0, password: str | None = None) -> "ResponseStore":
        client = aioredis.Redis.from_url(url, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, prefix, ttl_s, max_per_key)

    def _response(self, response_id: str) -> str:
        return f"{self.prefix}:response:{response_id}"

    def _of_key(self, key_id: str) -> str:
        return f"{self.prefix}:responses:key:{key_id}"

    def _of_user(self, user_id: str) -> str:
        return f"{self.prefix}:responses:user:{user_id}"

    @redis_unavailable("response store")
    async def put(self, response_id: str, key_id: str, user: str | None, conversation: list[dict[str, str]], response: dict[str, Any]) -> None:
        """Stores a response (module docstring); past max_per_key the key's oldest go."""
        record = json.dumps({"key_id": key_id, "user": user, "conversation": conversation, "response": response})
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.set(self._response(response_id), record, ex=self.ttl_s)
            pipe.zadd(self._of_key(key_id), {response_id: time.time()})
            pipe.expire(self._of_key(key_id), self.ttl_s)
            pipe.zremrangebyscore(self._of_key(key_id), "-inf", time.time() - self.ttl_s)  # the expired ones' entries
            if user is not None:
                pipe.sadd(self._of_user(user), response_id)
                pipe.expire(self._of_user(user), self.ttl_s)
            pipe.zcard(self._of_key(key_id))
            *_, count = await pipe.execute()
        if count > self.max_per_key:
            dropped = [member for member, _ in await self.r.zpopmin(self._of_key(key_id), count - self.max_per_key)]
            if dropped:
                await self.r.delete(*(self._response(m.decode()) for m in dropped))

    @redis_unavailable("response store")
    async def get(self, response_id: str, key_id: str) -> dict[str, Any] | None:
        """The stored record (key_id, user, conversation, response), or None: absent, expired, or another key's."""
        raw = await self.r.get(self._response(response_id))
        if raw is None:
            return None
        record: dict[str, Any] = json.loads(raw)
        return record if record.get("key_id") == key_id else None

    @redis_unavailable("response store")
    async def delete(self, response_id: str, key_id: str) -> bool:
        """Deletes a stored response of this key (False: none such)."""
        record = await self.get(response_id, key_id)
        if record is None:
            return False
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.delete(self._response(response_id))
            pipe.zrem(self._of_key(key_id), response_id)
            if record.get("user") is not None:
                pipe.srem(self._of_user(record["user"]), response_id)
            pipe.incr(self.keys.erasure_pending())  # Redis's files still hold the text: a rewrite is owed (memory.erasure)
            await pipe.execute()
        return True

    @redis_unavailable("response store")
    async def forget_user(self, user_id: str) -> int:
        """Deletes every response stored for `user_id` (with the user's memory); how many there were."""
        ids = [member.decode() for member in await self.r.smembers(self._of_user(user_id))]
        async with self.r.pipeline(transaction=True) as pipe:
            for response_id in ids:
                pipe.delete(self._response(response_id))
            pipe.delete(self._of_user(user_id))
            if ids:
                pipe.incr(self.keys.erasure_pending())
            await pipe.execute()
        return len(ids)

    async def close(self) -> None:
        await self.r.aclose()
