"""RedisBreaker: the shard's Redis commands fail at once while Redis is known to be away.

The shard serves its calls under one lock (actors/shard_actor.py). A Redis that stops answering
(SIGSTOP, a partition: the TCP connection stays open, no reply comes) made every write wait its
whole socket timeout (memory.redis_timeout_s) holding that lock, so chat plans, which need no Redis,
queued behind a stream of doomed adds and expired: on the H100 (bench/results/faults_h100.json,
Redis stopped 60 s) 9 of 13 prober chats answered 503 after 5 s.

After a connection error or a timeout the breaker opens: every command of the guarded client fails
at once with RedisAway (a RedisError, so the shard answers 503 with Retry-After; not a
ConnectionError, so redis-py's retry policy does not retry it). A background thread pings Redis
every `probe_interval_s` on its own short-timeout client and closes the breaker when Redis answers;
callers never wait on a trial.

Hand-written rather than pybreaker (what redis.multidb builds on): pybreaker is neither in this
project's lock nor in the GPU machine's wheel set, and pybreaker's half-open trial is a caller's own
command, which would hold the shard's lock for a whole timeout on every trial.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

logger = logging.getLogger(__name__)

FAILURES = (RedisConnectionError, RedisTimeoutError)  # no answer from Redis (an error reply is an answer)


class RedisAway(RedisError):
    """Refused without asking Redis: it did not answer lately and has not answered a ping since."""


class RedisBreaker:
    """Open from a failed command until a ping answers (see the module docstring)."""

    def __init__(self, ping: Callable[[], Any], probe_interval_s: float = 0.5, name: str = "redis") -> None:
        self.ping = ping
        self.probe_interval_s = probe_interval_s
        self.name = name
        self.opened_total = 0  # how many times it opened (stats)
        self._opened_at: float | None = None
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None

    def check(self) -> None:
        opened_at = self._opened_at
        if opened_at is not None:
            raise RedisAway(f"{self.name} has not answered for {time.monotonic() - opened_at:.1f} s; try again shortly")

    def failed(self, error: BaseException) -> None:
        with self._lock:
            if self._opened_at is not None:
                return
            self._opened_at = time.monotonic()
            self.opened_total += 1
        logger.warning("%s did not answer (%s: %s): its commands fail at once until a ping answers", self.name, type(error).__name__, error)
        threading.Thread(target=self._probe, name=f"{self.name}-breaker-probe", daemon=True).start()

    def _probe(self) -> None:
        while True:
            time.sleep(self.probe_interval_s)
            try:
                self.ping()
            except RedisError:
                continue
            with self._lock:
                away_s = time.monotonic() - (self._opened_at or time.monotonic())
                self._opened_at = None
            logger.warning("%s answers again after %.1f s", self.name, away_s)
            return


def guard(client: redis.Redis, breaker: RedisBreaker) -> redis.Redis:
    """`client` with every connection of its pool (commands, pipelines, transactions) behind `breaker`."""
    pool = client.connection_pool
    base = pool.connection_class

    class GuardedConnection(base):  # type: ignore[valid-type,misc]
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            breaker.check()
            try:
                return super().send_packed_command(command, check_health)
            except FAILURES as exc:
                breaker.failed(exc)
                raise

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().read_response(*args, **kwargs)
            except FAILURES as exc:
                breaker.failed(exc)
                raise

    GuardedConnection.__name__ = f"Guarded{base.__name__}"
    pool.connection_class = GuardedConnection
    pool.disconnect()  # connections made before are of the plain class
    return client
