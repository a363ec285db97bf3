"""IngressPresence: in how many ingress processes each API key was active lately, kept in Redis.

Each ingress process (a ChatAPI replica, or an LLM replica with `routing: direct`) keeps its own
admission buckets (serve_app.ingress.admission); a key whose requests are spread over n processes
would get n times its rate. So every `interval_s` each process writes, in one pipelined round trip,
the keys it admitted since the last time and reads back how many processes wrote each of them
within the last three intervals; the admission grants a key 1/n of its limits in each of them.
No Redis call is made per request, and none at all while no key is active.

    P:ingress:active:{key_id}    hash: process id -> last time (epoch s) it saw the key; expires

A Redis error keeps the last counts (StoreUnavailable is logged, never raised to a request).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import redis.asyncio as aioredis

from memory.directory import redis_unavailable
from memory.records import StoreUnavailable

logger = logging.getLogger(__name__)
FRESH_INTERVALS = 3  # a process that has not reported a key for this many intervals no longer counts


class IngressPresence:
    """This process's view of how widely each key is spread (serve_app.ingress.admission.KeySpread)."""

    def __init__(self, client: aioredis.Redis, prefix: str, interval_s: float, process_id: str | None = None) -> None:
        self.r = client
        self.prefix = prefix
        self.interval_s = interval_s
        self.process_id = process_id or uuid.uuid4().hex[:12]
        self._noted: set[str] = set()
        self._spread: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, prefix: str, interval_s: float, password: str | None = None, timeout_s: float = 1.0) -> "IngressPresence":
        client = aioredis.Redis.from_url(url, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, prefix, interval_s)

    def note(self, key_id: str) -> None:
        """`key_id` was admitted (or refused) here; reported at the next sync."""
        self._noted.add(key_id)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def processes(self, key_id: str) -> int:
        """Processes the key was active in at the last sync (1 before any)."""
        return self._spread.get(key_id, 1)

    async def _run(self) -> None:
        while self._noted:
            await asyncio.sleep(self.interval_s)
            noted, self._noted = self._noted, set()
            try:
                self._spread = await self.sync(noted)
            except StoreUnavailable as exc:
                logger.warning("admission: could not learn how widely keys are spread (%s); keeping the last counts", exc)

    @redis_unavailable("ingress presence")
    async def sync(self, key_ids: set[str]) -> dict[str, int]:
        """Reports `key_ids` as active in this process now; how many processes each is active in."""
        now = time.time()
        ttl = max(1, int(self.interval_s * FRESH_INTERVALS * 2))
        ordered = sorted(key_ids)
        pipe = self.r.pipeline(transaction=False)
        for key_id in ordered:
            name = f"{self.prefix}:ingress:active:{key_id}"
            pipe.hset(name, self.process_id, now)
            pipe.expire(name, ttl)
            pipe.hvals(name)
        replies = await pipe.execute()
        fresh_after = now - self.interval_s * FRESH_INTERVALS
        return {key_id: max(1, sum(float(t) >= fresh_after for t in replies[3 * i + 2])) for i, key_id in enumerate(ordered)}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.r.aclose()
