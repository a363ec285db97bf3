"""What a replica and its shard actor agree on besides the memory's own records: the probe group,
the probe's answer and the refusal of a call that arrived too late (no torch, no Redis: the
replica's client and watchdog import this, not the shard)."""

from __future__ import annotations

from dataclasses import dataclass

PROBE_GROUP = "probe"  # the concurrency group of the health probe: never queued behind the shard's calls


class CallExpired(TimeoutError):
    """A shard call reached the shard after its caller's deadline (`call_deadline`): not run."""


@dataclass(frozen=True)
class ShardHealth:
    """What a health probe finds, without waiting for the shard's lock."""

    status: str  # "ok", or what is wrong (Redis unreachable, the plan channel stopped)
    busy_with: str | None = None  # the call holding the shard's lock, if any
    busy_s: float = 0.0  # for how long it has held it
    shed_calls: int = 0  # calls dropped because their callers had given up (since the shard started)
