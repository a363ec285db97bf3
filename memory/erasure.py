"""RedisCompactor: after a delete, the deleted text leaves Redis's files too (AOF and RDB).

A delete removes a fact's text from Redis's memory at once (memory.fact_store, one transaction,
on disk before it is acknowledged: `appendfsync always`), but Redis's append-only file still
holds the commands that wrote the text until the file is rewritten, and an RDB snapshot holds it
until the next save. This module makes that rewrite happen, without rewriting per delete:

- the delete's own transaction increments a durable marker (RedisKeys.erasure_pending), so a
  rewrite owed survives a shard restart, and any shard's rewrite pays what every shard owes;
- `request()` only wakes a background thread; the thread waits `rewrite_delay_s` (a burst of
  deletes gathers into one rewrite) and keeps at least `rewrite_min_interval_s` between rewrites;
- a rewrite: read the marker, BGREWRITEAOF (after any rewrite already running, whose fork may
  predate the delete), wait until Redis reports it done, BGSAVE likewise when Redis keeps RDB
  snapshots (`CONFIG GET save` not empty), then clear the marker only if no delete came since
  (compare and delete under WATCH); a failure keeps the marker and is retried after the interval.

No Ray, no vLLM: the shard (memory.shard) owns one compactor.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable

import redis

from memory.settings import ErasureSettings

logger = logging.getLogger(__name__)


class RedisCompactor:
    """Coalesced, rate-limited AOF rewrites (and RDB saves) after deletes; see the module docstring."""

    def __init__(
        self,
        client: redis.Redis,
        marker_key: str,
        settings: ErasureSettings,
        name: str = "shard",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.r = client
        self.marker_key = marker_key
        self.settings = settings
        self.name = name
        self.clock = clock
        self.rewrites = 0  # rewrites this compactor ran (AOF, plus RDB where Redis saves snapshots)
        self.requests = 0  # deletes (or restarts) that asked for one
        self.failures = 0
        self.last_error: str | None = None
        self._last_rewrite_at = -math.inf
        self._pending_since: float | None = None
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"redis-compactor-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers
    def request(self) -> None:
        """A delete landed: make sure a rewrite follows (coalesced with any already owed)."""
        if not self.settings.compact_redis:
            return
        with self._wake:
            self.requests += 1
            if self._pending_since is None:
                self._pending_since = self.clock()
            self._wake.notify()

    def resume(self) -> None:
        """At start: request the rewrite a previous incarnation (or another shard) still owes."""
        if self.r.exists(self.marker_key):
            self.request()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=5)

    def stats(self) -> dict[str, Any]:
        return {
            "redis_rewrites_total": self.rewrites,
            "redis_rewrite_requests_total": self.requests,
            "redis_rewrite_failures_total": self.failures,
            "redis_rewrite_pending": self._pending_since is not None,
            "redis_rewrite_last_error": self.last_error,
        }

    # ------------------------------------------------------------------ the thread
    def _due_at(self) -> float:
        assert self._pending_since is not None
        return max(self._pending_since + self.settings.rewrite_delay_s, self._last_rewrite_at + self.settings.rewrite_min_interval_s)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (self._pending_since is None or self.clock() < self._due_at()):
                    timeout = None if self._pending_since is None else max(0.0, self._due_at() - self.clock())
                    self._wake.wait(timeout)
                if self._closed:
                    return
                self._pending_since = None  # requests from now on ask for the next rewrite
            started = self.clock()
            try:
                if self.compact_now():
                    self._last_rewrite_at = started  # the interval counts from a rewrite that ran
            except Exception as exc:  # noqa: BLE001 - Redis away or refusing: owed still, retried
                self._last_rewrite_at = started  # retried after the interval, not in a loop
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                logger.warning("%s: Redis rewrite after a delete failed (retried in %.0f s): %s",
                               self.name, self.settings.rewrite_min_interval_s, exc)  # fmt: skip
                with self._wake:
                    if self._pending_since is None:
                        self._pending_since = self.clock()

    def compact_now(self) -> bool:
        """Rewrite Redis's files if a delete is owed one; returns whether a rewrite ran."""
        owed = self.r.get(self.marker_key)
        if owed is None:
            return False  # another shard's rewrite (or none needed) covered every delete
        info = self.r.info("persistence")
        if int(info.get("aof_enabled", 0)):
            self._background("aof")
        if self._snapshots_enabled():
            self._background("rdb")
        self._clear_marker(owed)
        self.rewrites += 1
        logger.info("%s: Redis files rewritten after deletes (marker %s)", self.name, owed.decode())
        return True

    def _snapshots_enabled(self) -> bool:
        if not self.settings.rewrite_rdb:
            return False
        try:
            return bool(self.r.config_get("save").get("save"))
        except redis.ResponseError:  # CONFIG renamed away (managed Redis): its snapshots are its own
            return False

    def _background(self, kind: str) -> None:
        """Start a fresh BGREWRITEAOF / BGSAVE and wait until Redis reports it finished. One
        already running may have forked before the delete, so it is waited out first."""
        status = "aof_last_bgrewrite_status" if kind == "aof" else "rdb_last_bgsave_status"
        deadline = time.monotonic() + self.settings.rewrite_timeout_s
        started = False
        while not started:
            self._wait_idle(deadline)
            try:
                if kind == "aof":
                    self.r.bgrewriteaof()
                else:
                    self.r.bgsave()
                started = True
            except redis.ResponseError as exc:  # "already in progress": one began meanwhile
                if "progress" not in str(exc):
                    raise
        self._wait_idle(deadline)
        info = self.r.info("persistence")
        if info.get(status) != "ok":
            raise RuntimeError(f"Redis {kind} rewrite ended with status {info.get(status)!r}")

    def _wait_idle(self, deadline: float) -> None:
        """Until Redis runs no background save or rewrite and has none scheduled."""
        busy = ("aof_rewrite_in_progress", "aof_rewrite_scheduled", "rdb_bgsave_in_progress")
        while True:
            info = self.r.info("persistence")
            if not any(int(info.get(flag, 0)) for flag in busy):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Redis still saving after {self.settings.rewrite_timeout_s} s")
            time.sleep(self.settings.poll_s)

    def _clear_marker(self, owed: bytes) -> None:
        """Delete the marker only if it still holds `owed`: a delete that came since is owed a rewrite."""
        with self.r.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self.marker_key)
                if pipe.get(self.marker_key) != owed:
                    return
                pipe.multi()
                pipe.delete(self.marker_key)
                pipe.execute()
            except redis.WatchError:
                pass  # a delete landed meanwhile: the marker stays for the next rewrite
