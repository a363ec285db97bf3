"""Who goes first in the replica's engine: request priorities, and the count of chats running.

The engine runs with vLLM's priority scheduling (scheduling_policy="priority",
serve_app.replica.lifecycle), where a lower value is served first: a user's chat comes before
the extraction and reconciliation generations of anyone's add, and those before the background
capture requests that encode facts' KV. The background encoder (serve_app.replica.encode_driver)
also reads ChatsRunning: while chats run it sends small batches and pauses between them, so the
engine's steps are not filled with encode prompts (a priority only orders the waiting queue; an
encode already running shares every step with the chats).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

CHAT_PRIORITY = 0  # a user waits on it
MEMORY_WRITE_PRIORITY = 1  # extraction and reconciliation of an add (serve_app.replica.extraction, .reconciliation)
ENCODE_PRIORITY = 2  # background capture requests (serve_app.replica.encode_driver)


class ChatsRunning:
    """How many chats this replica is running now (planning, prefilling or decoding)."""

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def one(self) -> Iterator[None]:
        """Counts one chat while the block runs."""
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1

    def __call__(self) -> int:
        return self.count
