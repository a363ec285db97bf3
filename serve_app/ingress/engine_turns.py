"""EngineTurns: a key that spends its whole chat rate waits for other keys' chats before it starts.

Token buckets bound how often a key may start a chat, not what its chats cost the others while
they run: on the CPU engine a chat running beside another user's makes that one 1.45x slower, so
a key that starts a chat the moment its bucket allows (one that floods, or a busy backend) took
the engine from everyone beside it (bench/serve/tenants_flood.py --hostile, docs/hostile.md).

Admission marks a chat ticket `yields` when its key is at its limits: the key's bucket for chats
was below half its burst after the chat took its token (spending its rate as fast as it
refills), or a request of the key was refused (429: its rate, or its in-flight cap) within the
last few seconds (admission.SATURATED_FOR_S). Such a chat
waits here, after admission and before its body is read, while a chat of a key that does not
yield is running in this ingress process, at most `fair_turn_hold_s`; then it starts anyway (a
saturating key is slowed, never starved). Chats of keys within their rate never wait, and
yielding chats do not wait for each other. A key's chat that has waited still counts against its
in-flight cap, so the wait costs the key, not the service: a timer and a condition, no Ray call.
Per ingress process (one in both shipped configs): chats admitted in another process are not seen.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter


class EngineTurns:
    """Which keys have chats running that others yield to (see the module docstring)."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._running: Counter[str] = Counter()  # key -> its chats running that do not yield
        self._changed: asyncio.Condition | None = None  # made in the event loop that first waits
        self.waits = 0  # chats that waited for another key's (for the log and the tests)
        self.waited_s = 0.0

    def start(self, key_id: str) -> None:
        """A chat of `key_id` that does not yield has started."""
        self._running[key_id] += 1

    def end(self, key_id: str) -> None:
        """That chat has been answered: yielding chats may go."""
        self._running[key_id] -= 1
        if self._running[key_id] <= 0:
            del self._running[key_id]
        if self._changed is not None:
            asyncio.get_running_loop().create_task(self._notify())

    def others_running(self, key_id: str) -> bool:
        return any(key != key_id for key in self._running)

    async def wait_turn(self, key_id: str) -> float:
        """Wait while another key's non-yielding chat runs, at most hold_s; the seconds waited."""
        if self.hold_s <= 0 or not self.others_running(key_id):
            return 0.0
        if self._changed is None:
            self._changed = asyncio.Condition()
        started = time.perf_counter()
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: not self.others_running(key_id)), self.hold_s)
            except TimeoutError:
                pass  # slowed, never starved: the chat goes now
        waited = time.perf_counter() - started
        self.waits += 1
        self.waited_s += waited
        return waited

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()
