"""HTTP models of the memory API, in Mem0's shapes and field names.

One naming everywhere, Mem0's: a memory is `id`, `memory`, `user_id`, `metadata`, `created_at`,
`updated_at` (ISO 8601, UTC), and `score` in search hits; its history events are `memory_id`,
`event`, `old_memory`, `new_memory`, `created_at`. Requests come in two dialects that store the
same thing:
- this service's own (POST /v1/memories, /v1/memories/search): `user_id` at the top level, plus
  facts given directly, turns with their dialogue ids, `wait_for_kv`, `reconcile`;
- the Mem0 platform's v3 (POST /v3/memories/add/, /v3/memories/, /v3/memories/search/), as the
  official `mem0ai` client sends it: the user in `filters` (add: {"user_id": ...}; get_all and
  search: Mem0's v2 filter trees, serve_app.memory_filters), `top_k`.
Everything is bounded in characters and counts (the replica bounds tokens); unknown fields and
filters this service cannot read are refused by name (400), never ignored.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from memory.add_plan import AddResult
from memory.records import FactEvent, FactRecord, MemoryHit
from serve_app.client_limits import MAX_FACT_CHARS, MAX_FACTS_PER_ADD, MAX_TURN_CHARS, MAX_TURNS_PER_ADD
from serve_app.protocol import MAX_ID_CHARS, MAX_REQUEST_CHARS, NonBlank, bounded_depth, json_depth

logger = logging.getLogger(__name__)

MAX_ADD_MESSAGES = 8  # each user message costs one extraction request (up to 256 generated tokens)
MAX_METADATA_BYTES = 4_096  # compact JSON; counted against the user's text quota (memory.quota)
MAX_METADATA_DEPTH = 8  # levels of objects and arrays, the metadata object itself the first
MAX_SEARCH_RESULTS = 200


def _bounded_metadata(value: dict[str, Any]) -> dict[str, Any]:
    bounded_depth(value, MAX_METADATA_DEPTH, "metadata")  # first: json.dumps recurses
    try:  # NaN and Infinity parse (Python's json reads them) but no answer could carry them back
        size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode())
    except ValueError as exc:
        raise ValueError("metadata holds NaN or Infinity, which JSON answers cannot carry") from exc
    except UnicodeEncodeError as exc:
        raise ValueError("metadata holds a lone surrogate (\\ud800-\\udfff), which is not text") from exc
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"metadata of {size} bytes (compact JSON) exceeds {MAX_METADATA_BYTES}")
    return value


Metadata = Annotated[dict[str, Any], AfterValidator(_bounded_metadata)]
UserId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]


# ---------------------------------------------------------------------- requests (this service's own)
class MemoryMessage(BaseModel):
    """A conversation message given to memory add (recorded as a turn)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str = Field(..., max_length=MAX_TURN_CHARS)


class TurnIn(BaseModel):
    """A conversation turn given with facts (its id is what facts' source_id refers to)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    turn_id: str = Field(..., min_length=1, max_length=128)
    speaker: str = Field(..., min_length=1, max_length=128)
    text: str = Field(..., max_length=MAX_TURN_CHARS)
    session_time: str | None = Field(None, max_length=64)


class AddMemoryRequest(BaseModel):
    """Mem0 `add`: messages (facts extracted by the served model) or facts given directly."""

    model_config = ConfigDict(extra="forbid", strict=True)

    user_id: UserId
    messages: list[MemoryMessage] | None = Field(
        None, max_length=MAX_ADD_MESSAGES, description="Conversation turns to extract facts from (infer=true)."
    )
    facts: list[Annotated[NonBlank, Field(max_length=MAX_FACT_CHARS)]] | None = Field(
        None,
        max_length=MAX_FACTS_PER_ADD,
        description="Facts stored as given (source: the last turn, if any). Each must fit one KV arena entry "
        "(256 tokens by default); a longer one is refused with 400 and nothing is stored.",
    )
    turns: list[TurnIn] | None = Field(
        None, max_length=MAX_TURNS_PER_ADD, description="Turns to record before the facts (their context window)."
    )
    source_id: str | None = Field(None, min_length=1, max_length=128, description="Turn id the given facts come from.")
    metadata: Metadata | None = Field(None, description="A JSON object stored with every fact this add stores.")
    infer: bool = Field(True, description="Extract facts from `messages` with the served model; false stores the user messages as they are.")
    reconcile: bool | None = Field(
        None,
        description="Reconcile the extracted facts with the user's memory (ADD / UPDATE / DELETE / NONE, decided by the "
        "served model); null: the service's memory.reconcile setting.",
    )
    wait_for_kv: bool = Field(
        False,
        description="Answer only once the facts' KV is live (at most memory.add_encode_wait_s). By default an add "
        "answers as soon as its records are durable in Redis; the KV follows in the background (pending_encodes in "
        "/v1/shards) and chats prefill the facts as text until then.",
    )

    @model_validator(mode="after")
    def _something_to_add(self) -> "AddMemoryRequest":
        if not self.messages and not self.facts and not self.turns:
            raise ValueError("give messages, facts or turns")
        texts = [m.content for m in self.messages or []] + list(self.facts or []) + [t.text for t in self.turns or []]
        if (total := sum(len(text) for text in texts)) > MAX_REQUEST_CHARS:
            raise ValueError(f"messages, facts and turns hold {total} characters; at most {MAX_REQUEST_CHARS} per request")
        return self


class SearchMemoryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    user_id: UserId
    query: str = Field(..., min_length=1, max_length=MAX_TURN_CHARS)
    limit: int = Field(10, gt=0, le=MAX_SEARCH_RESULTS)
    threshold: float | None = Field(None, allow_inf_nan=False, description="Leave out hits scoring below this.")


class UpdateMemoryRequest(BaseModel):
    """New text, new metadata, or both (what is left out is kept)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: Annotated[NonBlank, Field(max_length=MAX_FACT_CHARS)] | None = Field(
        None, description="New text; must fit one KV arena entry."
    )
    metadata: Metadata | None = Field(None, description="Replaces the memory's metadata.")
    wait_for_kv: bool = Field(False, description="Answer only once the new text's KV is live, as for an add.")

    @model_validator(mode="after")
    def _something_to_change(self) -> "UpdateMemoryRequest":
        if self.text is None and self.metadata is None:
            raise ValueError("give text or metadata")
        return self


# ---------------------------------------------------------------------- requests (Mem0 platform v3)
class UserFilter(BaseModel):
    """Mem0's `filters`: this service keeps memories per user only, so `user_id` is the one filter."""

    model_config = ConfigDict(extra="forbid", strict=True)

    user_id: UserId


class Mem0AddRequest(BaseModel):
    """POST /v3/memories/add/ as `MemoryClient.add(messages, user_id=..., infer=..., metadata=...)` sends it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    messages: list[MemoryMessage] = Field(..., min_length=1, max_length=MAX_ADD_MESSAGES)
    user_id: UserId | None = None
    filters: UserFilter | None = None
    metadata: Metadata | None = None
    infer: bool = True

    @model_validator(mode="after")
    def _one_user(self) -> "Mem0AddRequest":
        users = {u for u in (self.user_id, self.filters.user_id if self.filters else None) if u is not None}
        if len(users) != 1:
            raise ValueError("name exactly one user: user_id, or filters.user_id")
        return self

    def as_add(self) -> AddMemoryRequest:
        user = self.user_id or (self.filters.user_id if self.filters else "")
        return AddMemoryRequest(user_id=user, messages=self.messages, metadata=self.metadata, infer=self.infer)


Mem0Filters = Annotated[dict[str, Any], Field(description="Mem0's v2 filters (serve_app.memory_filters): AND / OR / NOT over "
                                              "user_id, created_at, updated_at, metadata, keywords, memory_ids, ...")]


class Mem0ListRequest(BaseModel):
    """POST /v3/memories/ (get_all): `{"filters": {...}}` (Mem0's v2 filters); page and page_size are query parameters."""

    model_config = ConfigDict(extra="forbid", strict=True)

    filters: Mem0Filters
    version: Literal["v1", "v2"] | None = Field(None, description="Mem0's API version; both read filters the same way.")


class Mem0SearchRequest(BaseModel):
    """POST /v3/memories/search/ as `MemoryClient.search(query, filters=..., top_k=..., threshold=...)` sends it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    query: str = Field(..., min_length=1, max_length=MAX_TURN_CHARS)
    filters: Mem0Filters
    top_k: int = Field(10, gt=0, le=MAX_SEARCH_RESULTS)
    threshold: float | None = Field(None, allow_inf_nan=False)
    version: Literal["v1", "v2"] | None = Field(None, description="Mem0's API version; both read filters the same way.")


# ---------------------------------------------------------------------- answers
def iso_time(epoch_s: float) -> str:
    """An epoch time as Mem0 gives times: ISO 8601 with its UTC offset."""
    return datetime.fromtimestamp(epoch_s, tz=timezone.utc).isoformat()


def readable_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """Stored metadata as an answer may carry it: None for a value deeper than MAX_METADATA_DEPTH or
    holding NaN or Infinity, which only versions before these bounds could store (its serialization
    failed every read that carried it; a PUT with new metadata replaces it)."""
    if value is not None and json_depth(value) > MAX_METADATA_DEPTH:
        logger.warning("a stored memory's metadata nests deeper than %d levels; answered as null", MAX_METADATA_DEPTH)
        return None
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:  # NaN or Infinity, stored before they were refused: JSON answers cannot carry them
        logger.warning("a stored memory's metadata holds NaN or Infinity; answered as null")
        return None
    return value


class MemoryItem(BaseModel):
    """A memory as get, list and update answer it."""

    id: str
    memory: str
    user_id: str
    metadata: dict[str, Any] | None = None
    created_at: str
    updated_at: str
    version: int = Field(..., description="1 when added; each update adds one.")
    source_id: str | None = Field(None, description="The dialogue turn the memory came from.")
    session_time: str | None = Field(None, description="When that conversation happened, as the client gave it.")
    kv: str | None = Field(None, description="The state of the memory's KV on its shard: live | encoding | queued | "
                           "failed (served as text, see kv_error) | evicted | unknown.")
    kv_error: str | None = Field(None, description="Why the memory's last encode failed.")
    kv_attempts: int | None = Field(None, description="Failed encodes of this version.")

    @classmethod
    def of(cls, record: FactRecord) -> "MemoryItem":
        """From a FactRecord, or the shard's StoredFact (which adds the KV's state)."""
        return cls(
            id=record.fact_id, memory=record.text, user_id=record.user_id, metadata=readable_metadata(record.metadata),
            created_at=iso_time(record.created_at), updated_at=iso_time(record.updated_at), version=record.version,
            source_id=record.source_id, session_time=record.session_time,
            kv=getattr(record, "kv", None), kv_error=getattr(record, "kv_error", None), kv_attempts=getattr(record, "kv_attempts", None),
        )


class FilteredSearchHit(MemoryItem):
    """A memory as the Mem0 search route answers it: the whole memory and its score, most relevant first."""

    score: float


class MemorySearchHit(BaseModel):
    """A memory as search answers it: most relevant first."""

    id: str
    memory: str
    user_id: str
    score: float
    source_id: str | None = None

    @classmethod
    def of(cls, hit: MemoryHit, user_id: str) -> "MemorySearchHit":
        return cls(id=hit.fact_id, memory=hit.text, user_id=user_id, score=hit.score, source_id=hit.source_id)


class MemoryHistoryItem(BaseModel):
    """One event of a memory's history, oldest first; a delete erases the texts of every event."""

    id: str = Field(..., description="The event: memory id and version.")
    memory_id: str
    event: Literal["ADD", "UPDATE", "DELETE"]
    version: int
    old_memory: str | None = None
    new_memory: str | None = None
    created_at: str

    @classmethod
    def of(cls, event: FactEvent) -> "MemoryHistoryItem":
        return cls(
            id=f"{event.fact_id}-{event.version}-{event.event.lower()}", memory_id=event.fact_id, event=event.event,
            version=event.version, old_memory=event.old_text, new_memory=event.new_text, created_at=iso_time(event.at),
        )


def add_answer(result: AddResult) -> dict[str, Any]:
    """An add's answer in Mem0's shape: {"results": [{"id", "memory", "event", "previous_memory"?}],
    "extraction"?} (`previous_memory` on UPDATEs; `extraction` when facts were extracted: memory.grounding)."""
    results = []
    for outcome in result.outcomes:
        item = {"id": outcome.fact_id, "memory": outcome.text, "event": outcome.event}
        if outcome.event == "UPDATE":
            item["previous_memory"] = outcome.previous_text
        results.append(item)
    return {"results": results, **({"extraction": result.extraction.model_dump()} if result.extraction is not None else {})}
