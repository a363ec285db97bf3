"""Admission: token buckets and in-flight caps per key and per user, decided before a body is read.

The RequestGate (serve_app.ingress.gate) asks `Admission.admit` once the key is known and before
one byte of the body is received, so a refused request costs a dictionary look-up: no parse, no
Redis, no Ray call. The class of a request (chats, writes, reads) comes from its method and path
(`request_class`); its limits from `admission` (serve_app.client_limits.AdmissionSettings):

- a key bound to one user spends that user's buckets (`per_user`) in the gate;
- a key of several users spends its own buckets (`per_key`) in the gate, and the routes ask
  `admit_user` for the user the parsed body names before any call to a replica;
- chats and writes of one key running at once are capped (`max_engine_requests_per_key`, or
  `max_engine_requests_per_shared_key` for a key of several users; `max_writes_per_key`); one that
  comes back within the second its refusal said has its next refusal held too, and a connection
  that does costs its bucket a token as a rate refusal's would (a second process of a flooding
  key, looping on this refusal, otherwise kept the first one's chats running back to back);
- admin keys (and everyone with `auth.mode: off`) are the operator's: not limited.

A refusal is a 429 with `Retry-After` (whole seconds until a token is back, at least 1) and the
setting that refused it. A call on a connection that was told to wait and did not costs a token
all the same (the bucket goes into debt, at most one burst deep), so a client that keeps calling
while refused is never let through until it waits as told, while the user's other connections
that wait as told are not charged for it. A call that comes back before the user (or key) may
call again has its refusal held (at most `refusal_hold_s`, at most `max_held_per_key` at once)
before it is answered: a client that ignores Retry-After is paced to about one request per hold
per connection instead of one per round trip, with or without keep-alive. Holding costs a timer, not a parse. A client address that keeps calling
without a valid key has its 401s held the same way (`unauthenticated_hold`).

Several ingress processes (ChatAPI replicas, or LLM replicas with `routing: direct`) each keep
their own buckets; `KeySpread` tells in how many of them a key was active lately (learned through
Redis once per `sync_interval_s`: memory.ingress_presence), and each process grants 1/n of the
key's rates, bursts and caps. A single ingress process has no KeySpread and asks Redis nothing.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol

from memory.ingress_presence import IngressPresence
from memory.key_store import Principal
from serve_app.client_limits import AdmissionSettings, RateLimit
from serve_app.settings import ServiceSettings

RequestClass = Literal["chats", "writes", "reads"]
CHAT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"})  # they count as chats
ADD_PATHS = frozenset({"/v1/memories", "/v3/memories/add"})
RUNNING_KIND = {"chats": "engine", "writes": "writes"}  # the in-flight cap each class counts against
_IDLE_S = 120.0  # buckets untouched this long are full again: forgotten when the tables grow
_MAX_ENTRIES = 100_000


def request_class(verb: str, path: str) -> RequestClass:
    """chats (they run on the engine: chats, text completions, responses; and embeddings, which run in the
    LLM replica), writes (memory adds, updates, deletes) or reads (the rest)."""
    route = path.rstrip("/") or "/"
    if verb == "POST" and route in CHAT_PATHS:
        return "chats"
    if (verb == "POST" and route in ADD_PATHS) or (verb in ("PUT", "DELETE") and route.startswith("/v1/memories")):
        return "writes"
    return "reads"


class KeySpread(Protocol):
    """In how many ingress processes each key was active lately (memory.ingress_presence)."""

    def processes(self, key_id: str) -> int: ...

    def note(self, key_id: str) -> None: ...


class Refused(Exception):
    """A 429: `message` names the limit; `retry_after_s` whole seconds; answered after `hold_s`;
    `close`: answer with Connection: close (a key past its held refusals)."""

    def __init__(self, message: str, code: str, retry_after_s: int, hold_s: float = 0.0, close: bool = False) -> None:
        super().__init__(message)
        self.message, self.code, self.retry_after_s, self.hold_s, self.close = message, code, retry_after_s, hold_s, close

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} | ({"Connection": "close"} if self.close else {})


@dataclass
class _Bucket:
    tokens: float
    stamp: float
    retry_at: float = 0.0  # when the last refusal told the caller to come back

    def wait(self, limit: RateLimit, share: float, now: float) -> float:
        """Seconds until a token is there (0: now), after refilling."""
        rate, size = limit.per_s * share, max(1.0, limit.burst * share)
        self.tokens = min(size, self.tokens + (now - self.stamp) * rate)
        self.stamp = now
        return 0.0 if self.tokens >= 1.0 else (1.0 - self.tokens) / rate


@dataclass
class Ticket:
    """What an admitted request holds until it is answered (`Admission.release`)."""

    running: tuple[str, str] | None = None
    released: bool = field(default=False)


class Admission:
    """The buckets and counters of one ingress process (see the module docstring)."""

    def __init__(self, settings: AdmissionSettings, spread: KeySpread | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.spread = spread
        self._clock = clock
        self._buckets: dict[tuple[str, str, str], _Bucket] = {}
        self._running: Counter[tuple[str, str]] = Counter()
        self._held: Counter[str] = Counter()
        self._last_401: dict[str, float] = {}
        self._running_retry_at: dict[tuple[str, str], float] = {}  # when an in-flight refusal said to come back
        self._told: dict[tuple[tuple[str, str, str], str], float] = {}  # (bucket, connection) -> when it may call again

    @classmethod
    def of(cls, settings: ServiceSettings) -> "Admission":
        """The admission of one ingress process of the service `settings` describe: with a KeySpread
        when the service runs several ingress processes (ChatAPI replicas, or direct LLM replicas)."""
        processes = settings.llm_replicas if settings.routing == "direct" else settings.ingress_replicas
        spread = None
        if processes > 1 and settings.admission.enabled and settings.redis_url:
            spread = IngressPresence.from_url(
                settings.redis_url, settings.memory.redis_prefix, settings.admission.sync_interval_s, settings.redis_password_value()
            )
        return cls(settings.admission, spread)

    def limited(self, principal: Principal) -> bool:
        return self.settings.enabled and not principal.is_admin

    def admit(self, principal: Principal, kind: RequestClass, connection: str | None = None) -> Ticket:
        """A Ticket for a request of `kind` by `principal` over `connection` (the client's address and
        port: a refusal's debt is charged only to a connection that did not wait as it was told), or
        Refused (see the module docstring)."""
        if not self.limited(principal):
            return Ticket()
        key = principal.key_id
        if self.spread is not None:
            self.spread.note(key)
        share = self._share(key)
        (user,) = principal.users if principal.users is not None and len(principal.users) == 1 else (None,)
        scope = ("user", user, self.settings.per_user) if user is not None else ("key", key, self.settings.per_key)
        running = (key, RUNNING_KIND[kind]) if kind in RUNNING_KIND else None
        if running is not None:
            cap, setting = self._cap(running[1], principal)
            if self._running[running] >= max(1, math.floor(cap * share)):
                now = self._clock()
                early = self._running_retry_at.get(running, 0.0) > now  # told to retry in a second, and did not wait
                self._running_retry_at[running] = now + 1.0
                hold = self.settings.refusal_hold_s if early else 0.0
                told = ((scope[0], scope[1], kind), connection)
                if connection is not None:
                    if self._told.get(told, 0.0) > now:  # this connection was told to wait and did not: a token all the same
                        self._debit(told[0], getattr(scope[2], kind), share, now)
                    self._told[told] = now + hold + 1.0
                what = "chats and completions" if kind == "chats" else "memory writes"
                raise Refused(f"this key already has {self._running[running]} {what} running; at most {cap} at once "
                              f"(admission.{setting}); retry when one is answered", "too_many_requests_in_flight", 1, hold_s=hold)
        self._take(scope[0], scope[1], kind, getattr(scope[2], kind), share, key, connection)
        if running is not None:
            self._running[running] += 1
        return Ticket(running)

    def admit_user(self, principal: Principal, user_id: str, kind: RequestClass) -> None:
        """The user's buckets, for a key of several users once the body named the user (Refused past them)."""
        if not self.limited(principal) or principal.users is None or len(principal.users) < 2:
            return  # one user: spent in admit(); admin: not limited
        self._take("user", user_id, kind, getattr(self.settings.per_user, kind), self._share(principal.key_id), principal.key_id)

    def release(self, ticket: Ticket) -> None:
        if ticket.running is not None and not ticket.released:
            ticket.released = True
            self._running[ticket.running] -= 1
            if self._running[ticket.running] <= 0:
                del self._running[ticket.running]

    def unauthenticated_hold(self, address: str | None) -> float:
        """Seconds to hold a 401 for `address`: `refusal_hold_s` when the address was refused a key
        less than that long ago (a client looping without a valid key), at most `max_held_per_key`
        at once per address; 0 the first time. Costs a dictionary entry per address."""
        if not self.settings.enabled or address is None or self.settings.refusal_hold_s <= 0:
            return 0.0
        now = self._clock()
        last = self._last_401.get(address)
        self._last_401[address] = now
        if len(self._last_401) >= _MAX_ENTRIES:
            self._last_401 = {a: t for a, t in self._last_401.items() if now - t < self.settings.refusal_hold_s}
            self._running_retry_at = {k: t for k, t in self._running_retry_at.items() if t > now}
        early = last is not None and now - last < self.settings.refusal_hold_s
        return self.settings.refusal_hold_s if early and self._held[f"address:{address}"] < self.settings.max_held_per_key else 0.0

    def held(self, key_id: str) -> "_Hold":
        """Counts a refusal of `key_id` being held (`async with`)."""
        return _Hold(self._held, key_id)

    # ------------------------------------------------------------------ internals
    def _cap(self, kind: str, principal: Principal) -> tuple[int, str]:
        """The in-flight cap of `principal` for `kind` and the setting's name."""
        if kind != "engine":
            return self.settings.max_writes_per_key, "max_writes_per_key"
        if principal.users is not None and len(principal.users) > 1:
            return self.settings.max_engine_requests_per_shared_key, "max_engine_requests_per_shared_key"
        return self.settings.max_engine_requests_per_key, "max_engine_requests_per_key"

    def _share(self, key_id: str) -> float:
        return 1.0 / max(1, self.spread.processes(key_id)) if self.spread is not None else 1.0

    def _take(
        self, scope: str, name: str, kind: RequestClass, limit: RateLimit, share: float, key_id: str, connection: str | None = None
    ) -> None:
        now = self._clock()
        slot = (scope, name, kind)
        bucket = self._buckets.get(slot)
        if bucket is None:
            if len(self._buckets) >= _MAX_ENTRIES:
                self._forget_idle(now)
            bucket = self._buckets[slot] = _Bucket(tokens=max(1.0, limit.burst * share), stamp=now)
        wait = bucket.wait(limit, share, now)
        if wait <= 0.0:
            bucket.tokens -= 1.0
            return
        came_back_early = bucket.retry_at > now  # the user (or key) was told to wait: held
        told = (slot, connection)
        if connection is not None and self._told.get(told, 0.0) > now:
            # this very connection was told to wait and did not: the call costs a token all the same (down to
            # one burst of debt); other connections of the user that wait as they were told are never charged
            bucket.tokens = max(bucket.tokens - 1.0, -max(1.0, limit.burst * share))
            wait = (1.0 - bucket.tokens) / (limit.per_s * share)
        hold = min(self.settings.refusal_hold_s, wait) if came_back_early else 0.0
        close = hold > 0 and self._held[key_id] >= self.settings.max_held_per_key
        if close:
            hold = 0.0
        bucket.retry_at = now + wait
        retry_after = max(1, math.ceil(wait - hold))
        if connection is not None:
            if len(self._told) >= _MAX_ENTRIES:
                self._told = {k: t for k, t in self._told.items() if t > now}
            self._told[told] = now + hold + retry_after  # when it was told it may call again
        whose = f"user {name!r}" if scope == "user" else "this key"
        raise Refused(
            f"{whose} may send {kind} at {limit.per_s:g} a second (bursts of {limit.burst}: admission.per_{scope}.{kind}); "
            f"retry after {retry_after} s", "rate_limited", retry_after, hold, close,
        )

    def _debit(self, slot: tuple[str, str, str], limit: RateLimit, share: float, now: float) -> None:
        """One token from the bucket `slot`, down to one burst of debt."""
        bucket = self._buckets.get(slot)
        if bucket is None:
            if len(self._buckets) >= _MAX_ENTRIES:
                self._forget_idle(now)
            bucket = self._buckets[slot] = _Bucket(tokens=max(1.0, limit.burst * share), stamp=now)
        bucket.wait(limit, share, now)  # refilled up to now
        bucket.tokens = max(bucket.tokens - 1.0, -max(1.0, limit.burst * share))

    def _forget_idle(self, now: float) -> None:
        for slot in [s for s, b in self._buckets.items() if now - b.stamp > _IDLE_S]:
            del self._buckets[slot]
        if len(self._buckets) >= _MAX_ENTRIES:  # all busy: start over rather than grow without bound
            self._buckets.clear()


class _Hold:
    def __init__(self, counter: Counter[str], key_id: str) -> None:
        self.counter, self.key_id = counter, key_id

    async def __aenter__(self) -> None:
        self.counter[self.key_id] += 1

    async def __aexit__(self, *exc: object) -> None:
        self.counter[self.key_id] -= 1
        if self.counter[self.key_id] <= 0:
            del self.counter[self.key_id]
