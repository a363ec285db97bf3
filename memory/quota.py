"""What Redis may hold: per-user quotas (facts, turns, bytes of text) and their accounting, and
the report on Redis's own memory limit (maxmemory, policy noeviction) that the shards and /health give.

Each user's use is a Redis hash (memory.redis_keys: P:user:{u}:usage, fields facts, turns,
text_bytes) that memory.fact_store rewrites inside the same MULTI/EXEC as the write it accounts
for, under WATCH of that hash: a write and its accounting land together or not at all, whichever
replica or restarted shard makes them, and a delete frees what it removed. A user stored before
the hash existed has it derived once from their records (the facts set, the turns hash).

The bytes are UTF-8 bytes of stored text: fact texts and turn texts (what a tenant can grow);
ids, embeddings and history are bounded by the counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from memory.records import QuotaExceeded, Turn, content_bytes
from memory.redis_keys import RedisKeys
from memory.settings import QuotaSettings

USAGE_FIELDS = ("facts", "turns", "text_bytes")


@dataclass(frozen=True)
class Usage:
    """What a user keeps, or what a write adds (negative: frees)."""

    facts: int = 0
    turns: int = 0
    text_bytes: int = 0

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(self.facts + other.facts, self.turns + other.turns, self.text_bytes + other.text_bytes)

    def floored(self) -> "Usage":
        """Never below zero (a count derived after a partial, repaired write may be off by one)."""
        return Usage(max(0, self.facts), max(0, self.turns), max(0, self.text_bytes))


def text_bytes(text: str) -> int:
    return len(text.encode())


class UserQuota:
    """Reads, checks and (inside a caller's transaction) records a user's use (module docstring)."""

    def __init__(self, keys: RedisKeys, settings: QuotaSettings | None = None) -> None:
        self.keys = keys
        self.settings = settings or QuotaSettings(max_facts=0, max_turns=0, max_text_bytes=0)

    def usage_key(self, user_id: str) -> str:
        return self.keys.user(user_id, "usage")

    def read(self, client: Any, user_id: str) -> Usage:
        """The user's use (`client`: a Redis client, or a pipeline in immediate mode after WATCH)."""
        raw = client.hmget(self.usage_key(user_id), list(USAGE_FIELDS))
        if all(value is not None for value in raw):
            return Usage(*(int(value) for value in raw))
        return self.derive(client, user_id)

    def derive(self, client: Any, user_id: str) -> Usage:
        """The use counted from the user's records (a user stored before the counters existed)."""
        fact_ids = [x.decode() for x in client.smembers(self.keys.user(user_id, "facts"))]
        facts = [client.hmget(self.keys.fact(fact_id), ["text", "metadata"]) for fact_id in fact_ids]
        turns = client.hvals(self.keys.user(user_id, "turns"))
        stored = sum(content_bytes(json.loads(t), json.loads(m) if m else None) for t, m in facts if t is not None)
        stored += sum(text_bytes(Turn.model_validate_json(t).text) for t in turns)
        return Usage(facts=len(fact_ids), turns=len(turns), text_bytes=stored)

    def check(self, user_id: str, used: Usage, adding: Usage) -> None:
        """QuotaExceeded for the first limit `adding` would pass; a write that frees always passes."""
        for name in USAGE_FIELDS:
            more, limit = getattr(adding, name), getattr(self.settings, f"max_{name}")
            if limit and more > 0 and getattr(used, name) + more > limit:
                raise QuotaExceeded(user_id, name, getattr(used, name), more, limit)

    def record(self, pipe: Any, user_id: str, usage: Usage) -> None:
        """Queue the user's new use on `pipe` (inside MULTI, with the write it accounts for)."""
        pipe.hset(self.usage_key(user_id), mapping=dict(zip(USAGE_FIELDS, _as_tuple(usage.floored()))))


def _as_tuple(usage: Usage) -> tuple[int, int, int]:
    return usage.facts, usage.turns, usage.text_bytes


def redis_memory_report(used: int, limit: int, warn_fraction: float) -> dict[str, Any]:
    """{"used_bytes", "max_bytes", "fraction"} (fraction None without maxmemory), plus "warning"
    once the fraction is past `warn_fraction` (the ingress's /health reports the same)."""
    fraction = used / limit if limit else None
    report: dict[str, Any] = {"used_bytes": used, "max_bytes": limit, "fraction": round(fraction, 4) if fraction is not None else None}
    if fraction is not None and fraction >= warn_fraction:
        report["warning"] = (
            f"Redis holds {used} of its {limit} bytes ({fraction:.0%}, past {warn_fraction:.0%}): at maxmemory every "
            "memory write is refused (507); raise maxmemory or delete memories"
        )
    return report
