"""API keys, OpenAI style (`Authorization: Bearer <key>`): who may act for which users.

Each key is bound to the user ids it may act for, or to all of them (an admin key). Keys are
stored in Redis by their SHA-256 only: a key is 256 random bits, so a fast hash is as strong as
a slow password hash here and lets every request be checked with one Redis read (cached).

    P:apikey:{sha256}    hash: key_id, label, users (JSON list, or "*" for admin), created_at
    P:apikeys            hash: key_id -> sha256 (listing and revocation)

`auth.mode`: `keys` (the KubeRay manifests: an admin key comes from a Secret as
KVMEM_AUTH__ADMIN_KEY) or `off` (the embedded default: every caller acts as admin, so the
service must listen on loopback only, and says so when it starts).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, Field, SecretStr

KEY_PREFIX = "kvm-"


class AuthSettings(BaseModel):
    """Who may call the service."""

    mode: Literal["off", "keys"] = Field(
        "off",
        description="keys: every route needs a valid API key (Authorization: Bearer), checked against the user it "
        "touches; off: no checks, for a service on loopback only (the embedded default).",
    )
    admin_key: SecretStr | None = Field(
        None,
        description="An admin key accepted in keys mode and stored (hashed) at start; in Kubernetes from a Secret "
        "(KVMEM_AUTH__ADMIN_KEY). More keys: POST /v1/admin/keys or `python -m serve_app.keys_cli`.",
    )
    cache_ttl_s: float = Field(30.0, ge=0, description="How long the ingress trusts a key lookup (revocations take this long).")


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
        """The prefix-cache scope of this caller's requests that name no user."""
        return f"key:{self.key_id}"


ANONYMOUS_ADMIN = Principal(key_id="auth-off", users=None)


class KeyRecord(BaseModel):
    key_id: str
    label: str = ""
    users: list[str] | None = Field(None, description="User ids the key may act for; null: all (admin).")
    created_at: float


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
    def from_url(cls, url: str, prefix: str = "kvmem", cache_ttl_s: float = 30.0, timeout_s: float = 1.0) -> "KeyStore":
        client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, prefix, cache_ttl_s)

    def _key(self, digest: str) -> str:
        return f"{self.prefix}:apikey:{digest}"

    @property
    def _index(self) -> str:
        return f"{self.prefix}:apikeys"

    async def create(self, users: list[str] | None, label: str = "", key: str | None = None) -> tuple[str, KeyRecord]:
        """A new key (returned once, never stored in clear) bound to `users` (None: admin)."""
        key = key or KEY_PREFIX + secrets.token_urlsafe(32)
        digest = hash_key(key)
        existing = await self.r.hget(self._key(digest), "key_id")
        key_id = existing.decode() if existing else f"key_{uuid.uuid4().hex[:12]}"
        record = KeyRecord(key_id=key_id, label=label, users=sorted(set(users)) if users is not None else None, created_at=time.time())
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(
            self._key(digest),
            mapping={"key_id": key_id, "label": label, "users": json.dumps(record.users) if users is not None else "*",
                     "created_at": record.created_at},
        )
        pipe.hset(self._index, key_id, digest)
        await pipe.execute()
        self._cache.pop(digest, None)
        return key, record

    async def principal(self, key: str) -> Principal | None:
        """Who `key` acts as, or None for an unknown or revoked key."""
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

    async def list(self) -> list[KeyRecord]:
        records = []
        for key_id, digest in (await self.r.hgetall(self._index)).items():
            raw = await self.r.hgetall(self._key(digest.decode()))
            if raw:
                users = raw[b"users"].decode()
                records.append(KeyRecord(key_id=key_id.decode(), label=raw[b"label"].decode(),
                                         users=None if users == "*" else json.loads(users), created_at=float(raw[b"created_at"])))
        return sorted(records, key=lambda r: r.created_at)

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

    async def close(self) -> None:
        await self.r.aclose()
