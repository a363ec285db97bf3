"""ShardWatchdog: restarts a memory shard actor that is alive but has stopped answering.

Ray restarts a shard actor whose process dies (max_restarts=-1), but not one that stays up and
answers nothing: seen once on the H200 after Locust runs (bench/serve_h200.py), with the shard's
threads idle and every call, health included, timing out for minutes. The replica's Serve health
check (every 2 s) probes the shard through this watchdog; when no probe has been answered for
`restart_after_s`, it kills the actor with restart allowed, so Ray starts it again and the new
shard rebuilds its users from Redis and adopts the arena's live entries (as after a crash, see
tests/test_faults.py). A probe that fails fast (the actor restarting, or dead) is left to Ray.
`restart_after_s` stays well above the longest call a shard makes (an index build), since a
busy shard answers nothing either.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from actors.shard_client import ShardClient, ShardTimeout

logger = logging.getLogger(__name__)


def kill_for_restart(actor: Any) -> None:
    """Ray kills the actor's process and starts it again (its max_restarts allows it)."""
    import ray

    ray.kill(actor, no_restart=False)


class ShardWatchdog:
    def __init__(
        self,
        client: ShardClient,
        probe_timeout_s: float,
        restart_after_s: float,
        restart: Callable[[Any], None] = kill_for_restart,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.probe_timeout_s = probe_timeout_s
        self.restart_after_s = restart_after_s
        self._restart = restart
        self._clock = clock
        self.last_answer = clock()
        self.restarts = 0

    @property
    def silent_s(self) -> float:
        """Seconds since the shard last answered a probe."""
        return self._clock() - self.last_answer

    async def probe(self) -> str:
        """One health probe: "ok", or why not; restarts the shard once it has been silent too long."""
        try:
            state = await self.client.health(timeout_s=self.probe_timeout_s)
        except ShardTimeout as exc:
            if self.silent_s < self.restart_after_s:
                return f"unavailable: {exc}"
            logger.error("memory shard answered nothing for %.0f s: restarting it", self.silent_s)
            self._restart(self.client.actor)
            self.restarts += 1
            self.last_answer = self._clock()  # the restarted shard gets the same grace
            return f"restarted after {self.restart_after_s:.0f} s without an answer"
        except Exception as exc:  # noqa: BLE001 - dead or restarting: Ray brings it back
            self.last_answer = self._clock()
            return f"unavailable: {type(exc).__name__}: {exc}"[:300]
        self.last_answer = self._clock()
        return state
