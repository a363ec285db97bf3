"""ShardWatchdog: restarts a memory shard actor that is alive but wedged.

Ray restarts a shard actor whose process dies (max_restarts=-1), but not one that stays up and
does nothing. That happened on the H200 after Locust runs: every call of the replica waited
behind a cancelled one (fixed by actors/shard_actor.SHARD_ACTOR_OPTIONS); this is the net for
whatever else wedges a shard. The replica's Serve health check (every 2 s) probes the shard
through this watchdog. The probe runs in the shard's own probe group without its lock
(actors.shard_actor.ShardHealth), so it answers even while a call holds the shard, and says which
call and for how long. The watchdog kills the actor with restart allowed (Ray starts it again;
the new shard rebuilds its users from Redis and adopts the arena's live entries, as after a
crash, see tests/test_faults.py) when one call has held the shard for `restart_after_s`, or when
a shard that has answered before answers no probe at all for that long (its process is stuck).
A shard that has not answered since it (re)started is still loading, however long that takes,
and is never killed for it; a probe that fails fast (the actor restarting, or dead) is left to
Ray. `restart_after_s` stays well above the longest call a shard makes (an index build).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from actors.shard_calls import ShardHealth
from actors.shard_client import ShardClient, ShardTimeout

logger = logging.getLogger(__name__)


def kill_for_restart(actor: Any) -> None:
    """Ray kills the actor's process and starts it again (its max_restarts allows it)."""
    ray.kill(actor, no_restart=False)


class ShardWatchdog:
    def __init__(self, client: ShardClient, probe_timeout_s: float, restart_after_s: float) -> None:
        self.client = client
        self.probe_timeout_s = probe_timeout_s
        self.restart_after_s = restart_after_s
        self.last_answer = time.monotonic()
        self.answered = False  # since the watchdog started or last restarted the shard
        self.restarts = 0
        self.state = "starting: no probe has come back yet"  # the last probe's outcome (what health reports)
        self.probed_at: float | None = None  # when the last probe came back

    def report(self) -> str:
        """The shard's state as the last probe found it, without waiting for the shard: "ok", or
        why not; a probe that has not come back for a while says so (the Serve health check probes
        every few seconds, so a stale report means the probes themselves are stuck)."""
        if self.probed_at is None:
            return self.state
        stale_s = time.monotonic() - self.probed_at
        if stale_s > 3 * self.probe_timeout_s + 5:
            return f"unknown: no probe has come back for {stale_s:.0f} s (last: {self.state})"
        return self.state

    @property
    def silent_s(self) -> float:
        """Seconds since the shard last answered a probe."""
        return time.monotonic() - self.last_answer

    async def probe(self) -> str:
        """One health probe: "ok", or why not; restarts the shard once it has been silent too long."""
        self.state = await self._probe()
        self.probed_at = time.monotonic()
        return self.state

    async def _probe(self) -> str:
        try:
            health: ShardHealth = await self.client.health(timeout_s=self.probe_timeout_s)
        except ShardTimeout as exc:
            if not self.answered or self.silent_s < self.restart_after_s:
                return f"unavailable: {exc}"
            return self._restart(f"answered nothing for {self.silent_s:.0f} s")
        except Exception as exc:  # noqa: BLE001 - dead or restarting: Ray brings it back
            self.last_answer = time.monotonic()
            return f"unavailable: {type(exc).__name__}: {exc}"[:300]
        self.last_answer = time.monotonic()
        self.answered = True
        if health.busy_s > self.restart_after_s:
            return self._restart(f"{health.busy_with} has held it for {health.busy_s:.0f} s")
        if health.busy_s > self.probe_timeout_s:
            return f"{health.status} (busy: {health.busy_with} for {health.busy_s:.0f} s)"
        return health.status

    def _restart(self, why: str) -> str:
        logger.error("memory shard wedged (%s): restarting it", why)
        kill_for_restart(self.client.actor)
        self.restarts += 1
        self.last_answer = time.monotonic()
        self.answered = False  # loading again: left alone until it answers
        return f"restarted: {why}"
