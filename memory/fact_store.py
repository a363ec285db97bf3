"""FactStore: the durable memory records in Redis, the source of truth for every shard.

A shard's vector index and fact KV are derived from what is here and rebuilt from it after a
restart. Every write is one Redis transaction (MULTI/EXEC), so a record, its place in the
user's set, its history event and its de-duplication key land together or not at all: a fact
is acknowledged exactly when its transaction committed.

Every write also rewrites the user's use (memory.quota) in its own transaction, under WATCH of
the use hash, and refuses (QuotaExceeded, nothing written) one that would pass a quota.

Key layout: memory.redis_keys.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Sequence

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from memory.quota import Usage, UserQuota, text_bytes
from memory.settings import QuotaSettings
from memory.records import FactEvent, FactRecord, NewFact, Turn, UnknownFact, content_bytes, new_fact_id
from memory.redis_breaker import RedisBreaker, guard
from memory.redis_keys import RedisKeys, stable_shard


def _dedupe_key(text: str, source_id: str | None) -> str:
    return hashlib.sha1(f"{source_id or ''}\x00{text.strip()}".encode()).hexdigest()


class FactStore:
    """Redis-backed fact records, turns and shard assignments (see the module docstring)."""

    def __init__(self, client: redis.Redis, prefix: str = "kvmem", quota: QuotaSettings | None = None) -> None:
        self.r = client
        self.p = prefix
        self.keys = RedisKeys(prefix)
        self.quota = UserQuota(self.keys, quota)
        self.probe = client  # for memory_use: from_url gives it a short timeout and no retries

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "kvmem", timeout_s: float = 5.0, password: str | None = None, quota: QuotaSettings | None = None
    ) -> "FactStore":
        """A store over the Redis at `url` (`password`: its requirepass; one in the URL wins). Every
        command is bounded: `timeout_s` to connect and per reply; a command that fails on the
        connection is retried (redis-py's default policy, about 10 s in all), so a Redis restart
        stalls callers briefly instead of failing them. Once a command got no answer, every command
        fails at once (RedisAway) until Redis answers a ping again (memory.redis_breaker)."""
        client = redis.Redis.from_url(url, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        quick = min(timeout_s, 0.5)
        probe = redis.Redis.from_url(url, password=password, socket_timeout=quick, socket_connect_timeout=quick, retry=Retry(NoBackoff(), 0))
        store = cls(guard(client, RedisBreaker(probe.ping, name=f"redis ({prefix})")), prefix, quota)
        store.probe = probe
        return store

    # ------------------------------------------------------------------ keys
    def _fact(self, fact_id: str) -> str:
        return self.keys.fact(fact_id)

    def _history(self, fact_id: str) -> str:
        return self.keys.history(fact_id)

    def _user(self, user_id: str, what: str) -> str:
        return self.keys.user(user_id, what)

    # ------------------------------------------------------------------ shard assignment
    def shard_of(self, user_id: str, num_shards: int) -> int:
        """The user's shard: assigned once (stable hash), then read back, so it survives resizes."""
        key = self._user(user_id, "shard")
        current = self.r.get(key)
        if current is not None:
            return int(current)
        shard = stable_shard(user_id, num_shards)
        if self.r.set(key, shard, nx=True):
            self.r.sadd(self.keys.shard_users(shard), user_id)
            return shard
        return int(self.r.get(key))

    def claim_user(self, user_id: str, shard: int) -> None:
        """Record that `shard` holds the user's memory (what a restarted shard rebuilds from);
        refuses a user already held by another shard."""
        key = self._user(user_id, "shard")
        if self.r.set(key, shard, nx=True) or int(self.r.get(key)) == shard:
            self.r.sadd(self.keys.shard_users(shard), user_id)
            return
        raise ValueError(f"user {user_id!r} belongs to shard {int(self.r.get(key))}, not {shard}")

    def users_of_shard(self, shard: int) -> list[str]:
        return sorted(u.decode() for u in self.r.smembers(self.keys.shard_users(shard)))

    def user_of_fact(self, fact_id: str) -> str | None:
        user = self.r.hget(self._fact(fact_id), "user_id")
        return json.loads(user) if user is not None else None

    # ------------------------------------------------------------------ turns
    def add_turns(self, user_id: str, turns: Sequence[Turn]) -> None:
        """Record turns (a turn id given again replaces its turn); QuotaExceeded stores none."""
        if not turns:
            return
        by_id = {t.turn_id: t for t in turns}
        turns_key = self._user(user_id, "turns")

        def write(pipe: redis.client.Pipeline) -> None:
            used = self.quota.read(pipe, user_id)
            adding = self._turns_demand(pipe, user_id, list(by_id.values()))
            self.quota.check(user_id, used, adding)
            pipe.multi()
            pipe.hset(turns_key, mapping={t.turn_id: t.model_dump_json() for t in by_id.values()})
            pipe.zadd(self._user(user_id, "turn_order"), {t.turn_id: t.order for t in by_id.values()})
            self.quota.record(pipe, user_id, used + adding)

        self.r.transaction(write, self.quota.usage_key(user_id), turns_key)

    def _turns_demand(self, client: Any, user_id: str, turns: Sequence[Turn]) -> Usage:
        """What recording `turns` adds to the user's use (a replaced turn frees its old text)."""
        if not turns:
            return Usage()
        old = client.hmget(self._user(user_id, "turns"), [t.turn_id for t in turns])
        freed = sum(text_bytes(Turn.model_validate_json(o).text) for o in old if o is not None)
        new_bytes = sum(text_bytes(t.text) for t in turns)
        return Usage(turns=sum(1 for o in old if o is None), text_bytes=new_bytes - freed)

    # ------------------------------------------------------------------ quotas
    def memory_use(self) -> tuple[int, int]:
        """(used_memory, maxmemory) of the Redis server in bytes; maxmemory 0 means no limit."""
        info = self.probe.info("memory")
        return int(info["used_memory"]), int(info.get("maxmemory", 0))

    def usage(self, user_id: str) -> Usage:
        return self.quota.read(self.r, user_id)

    def check_room(self, user_id: str, facts: Sequence[NewFact] = (), turns: Sequence[Turn] = ()) -> Usage:
        """QuotaExceeded unless the user has room for all of `facts` and `turns` (those already
        stored, by de-duplication key or turn id, take no more); returns what they would add.
        A check before a request's first write, so a request past a quota stores nothing: each
        write checks again in its own transaction, so concurrent writes never pass a limit."""
        by_id = {t.turn_id: t for t in turns}
        adding = self._turns_demand(self.r, user_id, list(by_id.values()))
        keys = list(dict.fromkeys(_dedupe_key(f.text, f.source_id) for f in facts))
        if keys:
            known = self.r.hmget(self._user(user_id, "dedupe"), keys)
            sizes = {_dedupe_key(f.text, f.source_id): content_bytes(f.text.strip(), f.metadata) for f in facts}
            new = [k for k, fact_id in zip(keys, known) if fact_id is None]
            adding = adding + Usage(facts=len(new), text_bytes=sum(sizes[k] for k in new))
        self.quota.check(user_id, self.usage(user_id), adding)
        return adding

    def last_turn_order(self, user_id: str) -> float:
        last = self.r.zrange(self._user(user_id, "turn_order"), -1, -1, withscores=True)
        return float(last[0][1]) if last else -1.0

    def window_before(self, user_id: str, turn_id: str | None, w: int) -> list[Turn]:
        """The w turns before `turn_id`, oldest first ([] when unknown or w == 0)."""
        if turn_id is None or w <= 0:
            return []
        order_key = self._user(user_id, "turn_order")
        rank = self.r.zrank(order_key, turn_id)
        if rank is None or rank == 0:
            return []
        ids = self.r.zrange(order_key, max(0, rank - w), rank - 1)
        raw = self.r.hmget(self._user(user_id, "turns"), ids)
        return [Turn.model_validate_json(x) for x in raw if x is not None]

    # ------------------------------------------------------------------ facts
    def add(self, user_id: str, fact: NewFact, embedding: np.ndarray) -> tuple[FactRecord, bool]:
        """Store a fact durably; returns (record, created). Re-adding the same text from the same
        source returns the existing record (created=False), so a retried ingest makes no duplicates."""
        dedupe = self._user(user_id, "dedupe")
        key = _dedupe_key(fact.text, fact.source_id)
        now = time.time()
        record = FactRecord(
            fact_id=new_fact_id(),
            user_id=user_id,
            text=fact.text.strip(),
            source_id=fact.source_id,
            session_time=fact.session_time,
            metadata=fact.metadata,
            created_at=now,
            updated_at=now,
        )

        def claim(pipe: redis.client.Pipeline) -> str | None:
            existing = pipe.hget(dedupe, key)
            if existing is not None:
                pipe.multi()
                return existing.decode()
            used = self.quota.read(pipe, user_id)
            adding = Usage(facts=1, text_bytes=record.stored_bytes)
            self.quota.check(user_id, used, adding)
            pipe.multi()
            self.quota.record(pipe, user_id, used + adding)
            pipe.hset(dedupe, key, record.fact_id)
            pipe.hset(self._fact(record.fact_id), mapping=self._to_hash(record, embedding, key))
            pipe.sadd(self._user(user_id, "facts"), record.fact_id)
            event = FactEvent(event="ADD", fact_id=record.fact_id, version=1, new_text=record.text, at=now)
            pipe.rpush(self._history(record.fact_id), event.model_dump_json())
            return None

        existing = self.r.transaction(claim, dedupe, self.quota.usage_key(user_id), value_from_callable=True)
        if existing is not None:
            return self.get(existing, user_id), False
        return record, True

    def get(self, fact_id: str, user_id: str | None = None) -> FactRecord:
        record, _ = self.get_with_embedding(fact_id, user_id)
        return record

    def get_with_embedding(self, fact_id: str, user_id: str | None = None) -> tuple[FactRecord, np.ndarray]:
        raw = self.r.hgetall(self._fact(fact_id))
        if not raw or raw.get(b"deleted") == b"1":
            raise UnknownFact(f"no memory {fact_id!r}")
        record, embedding = self._from_hash(raw)
        if user_id is not None and record.user_id != user_id:
            raise UnknownFact(f"no memory {fact_id!r} for user {user_id!r}")
        return record, embedding

    def fact_ids(self, user_id: str) -> list[str]:
        return sorted(x.decode() for x in self.r.smembers(self._user(user_id, "facts")))

    def all_with_embeddings(self, user_id: str) -> list[tuple[FactRecord, np.ndarray]]:
        ids = self.fact_ids(user_id)
        pipe = self.r.pipeline(transaction=False)
        for fact_id in ids:
            pipe.hgetall(self._fact(fact_id))
        rows = [self._from_hash(raw) for raw in pipe.execute() if raw and raw.get(b"deleted") != b"1"]
        return sorted(rows, key=lambda row: row[0].created_at)

    def record_encoded_behind(self, fact_id: str, version: int, neighbours: Sequence[str]) -> None:
        """The facts a fact's KV (of `version`) was encoded behind (memory.encode_neighbours), so a
        restarted shard knows which KV to re-encode when one of them changes."""
        self.r.hset(self._fact(fact_id), "encoded_behind", json.dumps([version, list(neighbours)]))

    def encoded_behind(self, fact_ids: Sequence[str]) -> dict[str, tuple[int, tuple[str, ...]]]:
        """fact id -> (version, neighbour ids) as recorded by record_encoded_behind."""
        pipe = self.r.pipeline(transaction=False)
        for fact_id in fact_ids:
            pipe.hget(self._fact(fact_id), "encoded_behind")
        out = {}
        for fact_id, raw in zip(fact_ids, pipe.execute()):
            if raw is not None:
                version, neighbours = json.loads(raw)
                out[fact_id] = (int(version), tuple(neighbours))
        return out

    def get_all(self, user_id: str) -> list[FactRecord]:
        return [record for record, _ in self.all_with_embeddings(user_id)]

    def update(
        self, fact_id: str, user_id: str, text: str, embedding: np.ndarray, metadata: dict[str, Any] | None = None
    ) -> FactRecord:
        """A new version of the fact: its text, and its metadata when given (None keeps it)."""
        old = self.get(fact_id, user_id)
        now = time.time()
        changes: dict[str, Any] = {"text": text.strip(), "version": old.version + 1, "updated_at": now}
        if metadata is not None:
            changes["metadata"] = metadata
        new = old.model_copy(update=changes)
        new_key = _dedupe_key(new.text, new.source_id)
        old_key = self._dedupe_of(fact_id)

        def write(pipe: redis.client.Pipeline) -> None:
            used = self.quota.read(pipe, user_id)
            adding = Usage(text_bytes=new.stored_bytes - old.stored_bytes)
            self.quota.check(user_id, used, adding)
            pipe.multi()
            pipe.hdel(self._user(user_id, "dedupe"), old_key)
            pipe.hset(self._user(user_id, "dedupe"), new_key, fact_id)
            pipe.hset(self._fact(fact_id), mapping=self._to_hash(new, embedding, new_key))
            event = FactEvent(event="UPDATE", fact_id=fact_id, version=new.version, old_text=old.text, new_text=new.text, at=now)
            pipe.rpush(self._history(fact_id), event.model_dump_json())
            self.quota.record(pipe, user_id, used + adding)

        self.r.transaction(write, self.quota.usage_key(user_id))
        return new

    def delete(self, fact_id: str, user_id: str) -> FactRecord:
        """Erase a fact: its text, source and embedding leave Redis, its history keeps the events
        without text, and only the owner and a deletion mark stay (so the id keeps answering 404
        to others and its history to its owner). The same transaction raises the erasure marker:
        Redis's files are rewritten after it (memory.erasure)."""
        old = self.get(fact_id, user_id)
        now = time.time()
        events = [FactEvent.model_validate_json(x) for x in self.r.lrange(self._history(fact_id), 0, -1)]
        events.append(FactEvent(event="DELETE", fact_id=fact_id, version=old.version, at=now))
        dedupe_key = self._dedupe_of(fact_id)

        def write(pipe: redis.client.Pipeline) -> None:
            used = self.quota.read(pipe, user_id)  # before the fact leaves the set a derivation counts
            pipe.multi()
            pipe.srem(self._user(user_id, "facts"), fact_id)
            pipe.hdel(self._user(user_id, "dedupe"), dedupe_key)
            pipe.delete(self._fact(fact_id))
            pipe.hset(self._fact(fact_id), mapping={"user_id": json.dumps(user_id), "version": old.version, "deleted": "1", "updated_at": now})
            pipe.delete(self._history(fact_id))
            pipe.rpush(self._history(fact_id), *[e.model_copy(update={"old_text": None, "new_text": None}).model_dump_json() for e in events])
            self.quota.record(pipe, user_id, used + Usage(facts=-1, text_bytes=-old.stored_bytes))
            pipe.incr(self.keys.erasure_pending())  # Redis's files owe a rewrite (memory.erasure)

        self.r.transaction(write, self.quota.usage_key(user_id))
        return old

    def delete_all(self, user_id: str) -> list[str]:
        """Erase every fact of the user (as delete does), then the user's turns, de-duplication
        keys and shard placement: nothing of the user's text is left in Redis."""
        ids = self.fact_ids(user_id)
        for fact_id in ids:
            try:
                self.delete(fact_id, user_id)
            except UnknownFact:
                pass  # deleted concurrently
        shard = self.r.get(self._user(user_id, "shard"))
        pipe = self.r.pipeline(transaction=True)
        for what in ("facts", "dedupe", "turns", "turn_order", "shard", "usage"):
            pipe.delete(self._user(user_id, what))
        if shard is not None:
            pipe.srem(self.keys.shard_users(int(shard)), user_id)
        pipe.incr(self.keys.erasure_pending())  # the turns' text too: Redis's files owe a rewrite
        pipe.execute()
        return ids

    def history(self, fact_id: str, user_id: str | None = None) -> list[FactEvent]:
        owner = self.user_of_fact(fact_id)
        if owner is None or (user_id is not None and owner != user_id):
            raise UnknownFact(f"no memory {fact_id!r}" + (f" for user {user_id!r}" if user_id else ""))
        return [FactEvent.model_validate_json(x) for x in self.r.lrange(self._history(fact_id), 0, -1)]

    # ------------------------------------------------------------------ (de)serialisation
    def _dedupe_of(self, fact_id: str) -> str:
        key = self.r.hget(self._fact(fact_id), "dedupe")
        return key.decode() if key is not None else ""

    @staticmethod
    def _to_hash(record: FactRecord, embedding: np.ndarray, dedupe: str) -> dict[str, bytes | str]:
        fields = {k: json.dumps(v) for k, v in record.model_dump().items()}
        fields["embedding"] = np.ascontiguousarray(embedding, dtype=np.float32).tobytes()
        fields["dedupe"] = dedupe
        fields["deleted"] = "0"
        return fields

    @staticmethod
    def _from_hash(raw: dict[bytes, bytes]) -> tuple[FactRecord, np.ndarray]:
        names = FactRecord.model_fields
        record = FactRecord(**{k.decode(): json.loads(v) for k, v in raw.items() if k.decode() in names})
        embedding = np.frombuffer(raw.get(b"embedding", b""), dtype=np.float32).copy()
        return record, embedding
