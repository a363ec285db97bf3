"""Fairness between the users of one shard: the fair encode queue and the arena's LRU with a floor.

- FairQueue: the facts waiting for their KV, per user; take() serves the users in turn (round
  robin), so one user's backlog of thousands of facts delays another user's next fact by at most
  one fact per user ahead of it, not by the whole backlog.
- FloorLRU: the facts with live KV, least recently used first, counted per user. A user's
  `floor` most recently used entries can be evicted only to make room for that user's own facts:
  another user's adds evict from users above their floor (or their own), never below it.
- EncodeBacklogFull: an add refused because its user already has `max_pending_encodes_per_user`
  facts waiting for their KV (HTTP 429 with Retry-After; nothing of that add is stored).

Used by memory.kv_lifecycle (the KV life cycle of a shard). No Ray, no vLLM.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Collection, Iterator


class EncodeBacklogFull(RuntimeError):
    """A user's add would queue more encodes than max_pending_encodes_per_user: refused, nothing stored.
    The HTTP answer is 429 with Retry-After and code `encode_backlog_full`."""

    code = "encode_backlog_full"
    param = None

    def __init__(self, message: str, retry_after_s: int = 2) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class FairQueue:
    """Keys waiting for their encode, one deque per user, served round robin (module docstring).
    Supports what the life cycle used a deque for: append, appendleft (urgent), remove, `in`, len."""

    def __init__(self) -> None:
        self._by_user: OrderedDict[str, deque[str]] = OrderedDict()  # the next user to serve first
        self._owner: dict[str, str] = {}  # key -> user

    def append(self, key: str, user: str) -> None:
        """Queue `key` last among its user's keys (a new user is served after the users waiting)."""
        if key in self._owner:
            return
        self._owner[key] = user
        self._by_user.setdefault(user, deque()).append(key)

    def appendleft(self, key: str, user: str, user_next: bool = False) -> None:
        """Queue `key` first among its user's keys (a caller waits for it); `user_next`: and that
        user first in the turn (it was just taken and put back, so it keeps its turn)."""
        if key in self._owner:
            self.remove(key)
        self._owner[key] = user
        self._by_user.setdefault(user, deque()).appendleft(key)
        if user_next:
            self._by_user.move_to_end(user, last=False)

    def take(self, skip_users: Collection[str] = ()) -> tuple[str, str] | None:
        """(key, user) of the next key in round-robin order, skipping `skip_users`; None when empty.
        The user served goes to the back of the turn."""
        for user, keys in self._by_user.items():
            if user in skip_users:
                continue
            key = keys.popleft()
            del self._owner[key]
            if keys:
                self._by_user.move_to_end(user)
            else:
                del self._by_user[user]
            return key, user
        return None

    def remove(self, key: str) -> bool:
        """Drop `key` if queued; returns whether it was."""
        user = self._owner.pop(key, None)
        if user is None:
            return False
        keys = self._by_user[user]
        keys.remove(key)
        if not keys:
            del self._by_user[user]
        return True

    def queued_of(self, user: str) -> int:
        """How many of `user`'s keys are queued."""
        return len(self._by_user.get(user, ()))

    def __contains__(self, key: object) -> bool:
        return key in self._owner

    def __len__(self) -> int:
        return len(self._owner)

    def __iter__(self) -> Iterator[str]:
        """Every queued key (per user, in the users' turn order)."""
        for keys in list(self._by_user.values()):
            yield from list(keys)


class FloorLRU:
    """Facts with live KV, least recently used first, counted per user; eviction keeps each user's
    `floor` entries from other users' facts (module docstring). floor 0: one plain LRU."""

    def __init__(self, floor: int = 0) -> None:
        self.floor = floor
        self._order: OrderedDict[str, str] = OrderedDict()  # key -> user, least recently used first
        self._count: dict[str, int] = {}  # user -> live entries

    def add(self, key: str, user: str) -> None:
        """A key whose KV went live (most recently used)."""
        if key in self._order:
            self._order.move_to_end(key)
            return
        self._order[key] = user
        self._count[user] = self._count.get(user, 0) + 1

    def touch(self, key: str) -> None:
        """A key in use: most recently used."""
        self._order.move_to_end(key)

    def discard(self, key: str) -> None:
        user = self._order.pop(key, None)
        if user is None:
            return
        self._count[user] -= 1
        if not self._count[user]:
            del self._count[user]

    def victims_for(self, user: str) -> Iterator[str]:
        """Keys that may be evicted to make room for a fact of `user`, least recently used first:
        `user`'s own, and other users' while those users hold more than the floor. (The caller
        evicts one and asks again: the counts change with each eviction.)"""
        for key, owner in self._order.items():
            if owner == user or self._count[owner] > self.floor:
                yield key

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._order))
