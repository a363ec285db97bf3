"""Who goes first in the replica's engine: request priorities, and the count of chats running.

The engine runs with vLLM's priority scheduling (scheduling_policy="priority",
serve_app.replica.lifecycle), where a lower value is served first: a user's chat comes before
the extraction and reconciliation generations of anyone's add, and those before the background
capture requests that encode facts' KV. The background encoder (serve_app.replica.encode_driver)
also reads ChatsRunning: while chats run it sends small batches, starts each in a gap between chats
(when none is running, waiting a bounded time for one) and pauses between them, so the engine's
steps are not filled with encode prompts (a priority only orders the waiting queue; an
encode already running shares every step with the chats).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

CHAT_PRIORITY = 0  # a user waits on it
MEMORY_WRITE_PRIORITY = 1  # extraction and reconciliation of an add (serve_app.replica.extraction, .reconciliation)
ENCODE_PRIORITY = 2  # background capture requests (serve_app.replica.encode_driver)


# A chat that ended this recently still counts as chatting: a client's next chat usually follows
# within milliseconds, and a full encode batch started in that gap would delay it by seconds.
CHAT_GRACE_S = 1.0


class ChatsRunning:
    """Whether this replica is serving chats: running now (planning, prefilling or decoding), or
    one ended within CHAT_GRACE_S."""

    def __init__(self, grace_s: float = CHAT_GRACE_S) -> None:
        self.count = 0
        self.grace_s = grace_s
        self.last_ended = float("-inf")  # time.monotonic() of the last chat's end

    @contextlib.contextmanager
    def one(self) -> Iterator[None]:
        """Counts one chat while the block runs."""
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1
            self.last_ended = time.monotonic()

    def __call__(self) -> bool:
        return self.count > 0 or time.monotonic() - self.last_ended < self.grace_s

    def running_now(self) -> bool:
        """A chat is being served at this moment (not only within the grace)."""
        return self.count > 0
