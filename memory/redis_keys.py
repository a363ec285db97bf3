"""The Redis key layout of the memory records, in one place for every process that reads it.

The shard writes through memory.fact_store.FactStore; the ingress reads the routing keys
(user -> shard, fact -> owner) through memory.directory.UserDirectory. Prefix P, default "kvmem":

    P:fact:{id}               hash: the FactRecord fields (embedding as float32 bytes); after a
                              delete only the owner, version and deletion mark remain
    P:fact:{id}:history       list of JSON FactEvent, oldest first (kept after delete, without text)
    P:user:{u}:facts          set of the user's live fact ids
    P:user:{u}:dedupe         hash sha1(text, source) -> fact id (re-adding returns the existing fact)
    P:user:{u}:turns          hash turn id -> JSON Turn
    P:user:{u}:turn_order     sorted set of turn ids by conversation order
    P:user:{u}:usage          hash facts, turns, text_bytes: the user's use (memory.quota), rewritten in
                              each write's own transaction
    P:user:{u}:shard          the shard holding the user's memory
    P:shard:{s}:users         set of users assigned to shard s
    P:erasure:pending         counter, raised by every delete's transaction: Redis's files still
                              hold deleted text until a rewrite clears it (memory.erasure)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class RedisKeys:
    prefix: str = "kvmem"

    def fact(self, fact_id: str) -> str:
        return f"{self.prefix}:fact:{fact_id}"

    def history(self, fact_id: str) -> str:
        return f"{self.prefix}:fact:{fact_id}:history"

    def user(self, user_id: str, what: str) -> str:
        return f"{self.prefix}:user:{user_id}:{what}"

    def shard_users(self, shard: int) -> str:
        return f"{self.prefix}:shard:{shard}:users"

    def erasure_pending(self) -> str:
        return f"{self.prefix}:erasure:pending"


def stable_shard(user_id: str, num_shards: int) -> int:
    """The shard a new user is assigned to (a stable hash: the same on every process)."""
    return int(hashlib.sha1(user_id.encode()).hexdigest(), 16) % num_shards
