"""API keys in Redis, stored by their SHA-256 only (serve_app.ingress.auth decides what a key may do).

A key is 256 random bits, so a fast hash is as strong as a slow password hash here and lets every
request be checked with one Redis read (cached for `cache_ttl_s`).

    P:apikey:{sha256}    hash: key_id, label, users (JSON list, or "*" for admin), created_at
    P:apikeys            hash: key_id -> sha256 (listing and revocation)

A key is either an admin key (`admin=True`: every user) or bound to a non-empty list of user ids;
nothing else is minted ("no users" never means admin). The settings admin key
(`auth.admin_key`) is never stored here: serve_app.ingress.auth compares it. Before that, each
ingress stored its hash at start under the label "admin (settings)", so a rotated Secret's old key
kept working; `revoke_settings_copies` removes those copies (the label is reserved, so only the
old code's copies carry it).

Reads and writes use redis.asyncio with short socket timeouts; a Redis error surfaces as
memory.records.StoreUnavailable, so callers need not import redis-py.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Sequence

import redis.asyncio as aioredis
from pydantic import BaseModel, Field, computed_field

from memory.directory import redis_unavailable

KEY_PREFIX = "kvm-"
SETTINGS_COPY_LABEL = "admin (settings)"  # what the old code stored the settings admin key as; reserved


@dataclass(frozen=True)
class Principal:
    """Who a request acts as: a key and the users it may act for (None: every user)."""

    key_id: str
    users: frozenset[str] | None

    @property
    def is_admin(self) -> bool:
        return self.users is None

    def may_act_for(self, user_id: str) -> bool:
        return self.users is None or user_id in self.users

    @property
    def cache_scope(self) -> str:
        """The prefix-cache scope of this caller's requests that name no user: the key's id, salted
        in the key namespace (memory.composition.key_salt), which no user id can reach."""
        return self.key_id


class KeyRecord(BaseModel):
    key_id: str
    label: str = ""
    users: list[str] | None = Field(None, description="User ids the key may act for; null: all (admin).")
    created_at: float

    @computed_field(description="Whether the key acts for every user.")  # type: ignore[prop-decorator]
    @property
    def admin(self) -> bool:
        return self.users is None


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    """API keys in Redis, by hash (see the module docstring)."""

    def __init__(self, client: aioredis.Redis, prefix: str = "kvmem", cache_ttl_s: float = 30.0) -> None:
        self.r = client
        self.prefix = prefix
        self.cache_ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[float, Principal | None]] = {}

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "kvmem", cache_ttl_s: float = 30.0, timeout_s: float = 1.0, password: str | None = None
    ) -> "KeyStore":
        """A key store over the Redis at `url` (`password`: its requirepass; one in the URL wins)."""
        client = aioredis.Redis.from_url(url, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, prefix, cache_ttl_s)

    def _key(self, digest: str) -> str:
        return f"{self.prefix}:apikey:{digest}"

    @property
    def _index(self) -> str:
        return f"{self.prefix}:apikeys"

    async def create(self, users: Sequence[str] = (), *, admin: bool = False, label: str = "") -> tuple[str, KeyRecord]:
        """A new key (returned once, never stored in clear): an admin key when `admin` is True, else
        bound to `users`, which must name at least one user (ValueError otherwise)."""
        if isinstance(users, str) or users is None:
            raise TypeError("users: a list of user ids")
        if admin == bool(users):
            raise ValueError("a key is either an admin key (admin=True, no users) or bound to at least one user")
        if any(not isinstance(user, str) or not user for user in users):
            raise ValueError("users: every user id is a non-empty string")
        if label == SETTINGS_COPY_LABEL:
            raise ValueError(f"the label {SETTINGS_COPY_LABEL!r} is reserved")
        return await self._store(None if admin else sorted(set(users)), label)

    @redis_unavailable("key store")
    async def _store(self, users: list[str] | None, label: str) -> tuple[str, KeyRecord]:
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        digest = hash_key(key)
        record = KeyRecord(key_id=f"key_{uuid.uuid4().hex[:12]}", label=label, users=users, created_at=time.time())
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(
            self._key(digest),
            mapping={"key_id": record.key_id, "label": label, "users": "*" if users is None else json.dumps(users),
                     "created_at": record.created_at},
        )
        pipe.hset(self._index, record.key_id, digest)
        await pipe.execute()
        self._cache.pop(digest, None)
        return key, record

    @redis_unavailable("key store")
    async def principal(self, key: str) -> Principal | None:
        """Who `key` acts as, or None for an unknown or revoked key (StoreUnavailable: Redis did not answer)."""
        digest = hash_key(key)
        cached = self._cache.get(digest)
        if cached is not None and time.monotonic() - cached[0] < self.cache_ttl_s:
            return cached[1]
        raw = await self.r.hgetall(self._key(digest))
        principal = None
        if raw:
            users = raw[b"users"].decode()
            principal = Principal(raw[b"key_id"].decode(), None if users == "*" else frozenset(json.loads(users)))
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[digest] = (time.monotonic(), principal)
        return principal

    @redis_unavailable("key store")
    async def list(self) -> list[KeyRecord]:
        records = []
        for key_id, digest in (await self.r.hgetall(self._index)).items():
            raw = await self.r.hgetall(self._key(digest.decode()))
            if raw:
                users = raw[b"users"].decode()
                records.append(KeyRecord(key_id=key_id.decode(), label=raw[b"label"].decode(),
                                         users=None if users == "*" else json.loads(users), created_at=float(raw[b"created_at"])))
        return sorted(records, key=lambda r: r.created_at)

    @redis_unavailable("key store")
    async def revoke(self, key_id: str) -> bool:
        digest = await self.r.hget(self._index, key_id)
        if digest is None:
            return False
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self._key(digest.decode()))
        pipe.hdel(self._index, key_id)
        await pipe.execute()
        self._cache.pop(digest.decode(), None)
        return True

    async def revoke_settings_copies(self) -> int:
        """Revokes every stored copy of a settings admin key (an admin key labelled
        SETTINGS_COPY_LABEL, which only the old code wrote); how many there were."""
        copies = [r.key_id for r in await self.list() if r.label == SETTINGS_COPY_LABEL and r.users is None]
        return sum([await self.revoke(key_id) for key_id in copies])

    async def close(self) -> None:
        await self.r.aclose()
