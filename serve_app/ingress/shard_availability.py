"""ShardAvailability: which shards' LLM replicas are running, as Serve's controller sees them.

When a shard's LLM replica dies, Serve starts a replacement, and a request sent through the
shard's handle meanwhile waits in Serve's queue until the replacement is up: tens of seconds on a
CPU (docs/measured.md), longer than a client should wait without an answer. The router
(serve_app.ingress.router.ChatAPI) asks this instead, before it sends a request: for a shard whose
deployment has no RUNNING replica it answers 503 with Retry-After at once. The state is polled from
the controller (`serve.status()`, in a thread, every `period_s`), not guessed from timeouts: a busy
replica that answers slowly is never shed. Optimistic when the controller cannot be asked (a shard
is "down" only on the controller's word). serve_app.ingress.replica_calls.answer_unless gives up a
call to a shard as soon as its replica is known to be down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import HTTPException
from ray import serve

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "5"


class ShardAvailability:
    """Polls the controller for the shards' deployments (by their handles' names)."""

    def __init__(self, handles: list[Any], period_s: float = 1.0) -> None:
        self.names = [(h.app_name, h.deployment_name) for h in handles]
        self.period_s = period_s
        self.down_since: dict[int, float] = {}
        self.running: dict[int, int] = {}  # RUNNING replicas per shard's deployment, as last polled
        self._task: asyncio.Task | None = None

    def ensure_polling(self) -> None:
        """Starts the poller on the running event loop (once; again if it ever stopped)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            try:
                self.update(await asyncio.to_thread(_serve_status))
            except Exception as exc:  # noqa: BLE001 - the controller busy or restarting: keep the last state
                logger.debug("serve.status() failed: %s", exc)
            await asyncio.sleep(self.period_s)

    def update(self, status: Any) -> None:
        """New state from a ServeStatus: a shard is down while its deployment has no RUNNING replica."""
        now = time.monotonic()
        for shard, (app, deployment) in enumerate(self.names):
            application = status.applications.get(app)
            overview = application.deployments.get(deployment) if application is not None else None
            if overview is None:
                continue  # not deployed yet (start-up) or renamed: no opinion
            running = self.running[shard] = _count(overview.replica_states, "RUNNING")
            if running == 0:
                if shard not in self.down_since:
                    logger.warning("shard %d: no running replica of %s; answering 503 until one runs", shard, deployment)
                self.down_since.setdefault(shard, now)
            elif self.down_since.pop(shard, None) is not None:
                logger.info("shard %d: %s is running again", shard, deployment)

    def running_total(self) -> int | None:
        """RUNNING replicas over every shard's deployment, once each has been polled (else None)."""
        return sum(self.running.values()) if len(self.running) == len(self.names) else None

    def refusal(self, shard: int) -> HTTPException | None:
        """503 with Retry-After for a shard without a running replica, else None."""
        since = self.down_since.get(shard)
        if since is None:
            return None
        message = f"shard {shard}'s replica is restarting ({time.monotonic() - since:.0f} s so far); try again shortly"
        return HTTPException(503, message, {"Retry-After": RETRY_AFTER_S})


def _serve_status() -> Any:
    return serve.status()


def _count(states: dict[Any, int], name: str) -> int:
    """The count of replicas in state `name` (keys are ReplicaState enums or their values)."""
    return sum(n for state, n in states.items() if getattr(state, "value", state) == name)


