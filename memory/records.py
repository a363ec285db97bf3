"""The memory's records: conversation turns, facts and their history, as every room sees them.

Plain pydantic models, no Redis and no numpy: the ingress, the replica and the shard exchange
these (memory.fact_store keeps them durable in Redis; memory.redis_keys says where).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

_FACT_ID = re.compile(r"[0-9a-f]{32}")  # what new_fact_id mints: 128 random bits, lower-case hex


def new_fact_id() -> str:
    """A new fact id (memory.fact_store mints every fact's id here)."""
    return uuid.uuid4().hex


def is_fact_id(text: str) -> bool:
    """Whether `text` has the exact shape of a minted fact id. The ingress answers anything else
    "not found" without asking Redis, so an id cannot name another Redis key (a fact's history
    list, a user's set) and no id shape answers differently from a missing fact."""
    return _FACT_ID.fullmatch(text) is not None


class StoreUnavailable(ConnectionError):
    """Redis did not answer in time or refused the call: the HTTP answer is 503 with Retry-After, not 500
    (raised by memory.directory and memory.key_store for the ingress, and by the shard actor for its calls)."""


class StoreFull(StoreUnavailable):
    """Redis refused a write for memory (maxmemory reached, policy noeviction): nothing of the write
    was applied (a refused MULTI/EXEC is discarded whole). The HTTP answer is 507 with Retry-After."""

    code = "memory_store_full"
    param = None


class QuotaExceeded(Exception):
    """A write would take the user past one of their quotas (memory.quota); nothing was stored.
    The HTTP answer is 429 with code `quota_exceeded`. The arguments are kept as `args` so the error
    crosses Ray's process boundary (pickled by its arguments)."""

    code = "quota_exceeded"

    def __init__(self, user_id: str, quota: str, used: int, adding: int, limit: int) -> None:
        super().__init__(user_id, quota, used, adding, limit)
        self.user_id, self.quota, self.used, self.adding, self.limit = user_id, quota, used, adding, limit

    @property
    def param(self) -> str:
        """The setting whose limit was reached (the error's `param`)."""
        return f"memory.quota.max_{self.quota}"

    def __str__(self) -> str:
        return self.message

    @property
    def message(self) -> str:
        return (
            f"quota exceeded: user {self.user_id!r} has {self.used} of {self.limit} {self.quota} "
            f"(memory.quota.max_{self.quota}) and this request would add {self.adding}; delete memories to free quota"
        )


class UnknownFact(KeyError):
    """No live fact with this id (for this user)."""


class Turn(BaseModel):
    """One conversation turn (the context window facts are encoded with)."""

    turn_id: str = Field(..., min_length=1, description="Dialogue id, e.g. 'D1:3'; unique per user.")
    speaker: str = Field(..., description="Who said it.")
    text: str = Field(..., description="What was said.")
    order: float = Field(..., description="Position in the user's conversation history (ascending).")
    session_time: str | None = Field(None, description="Session date/time as given by the source.")


class NewFact(BaseModel):
    """A fact to add: its text and where it came from."""

    text: str = Field(..., min_length=1, max_length=2000, description="The fact, one sentence.")
    source_id: str | None = Field(None, description="Turn id the fact was extracted from (its window ends there).")
    session_time: str | None = Field(None, description="When the source conversation happened.")
    metadata: dict[str, Any] | None = Field(None, description="The client's JSON object, kept with the fact (Mem0's metadata).")


class FactRecord(BaseModel):
    fact_id: str
    user_id: str
    text: str
    source_id: str | None = None
    session_time: str | None = None
    metadata: dict[str, Any] | None = None
    version: int = 1
    created_at: float
    updated_at: float

    @property
    def stored_bytes(self) -> int:
        """What the record's client-given content costs against the user's text quota (memory.quota)."""
        return content_bytes(self.text, self.metadata)


def content_bytes(text: str, metadata: dict[str, Any] | None = None) -> int:
    """UTF-8 bytes of a fact's text plus its metadata as compact UTF-8 JSON (what memory.quota counts)."""
    size = len(text.encode())
    if metadata:
        size += len(json.dumps(metadata, separators=(",", ":"), ensure_ascii=False).encode())
    return size


class FactEvent(BaseModel):
    event: Literal["ADD", "UPDATE", "DELETE"]
    fact_id: str
    version: int
    old_text: str | None = None
    new_text: str | None = None
    at: float


@dataclass
class MemoryHit:
    """A fact as retrieved for a query: its id, text, similarity score and source turn."""

    fact_id: str
    text: str
    score: float
    source_id: str | None = None
