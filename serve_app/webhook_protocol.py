"""HTTP models of the Mem0 webhook routes (serve_app.ingress.webhook_routes), in Mem0's shapes.

Create takes `url`, `name`, `event_types`; update any of them (and `is_active`). A webhook is
answered as Mem0's platform answers it (`webhook_id`, `name`, `url`, `owner`, `event_types`,
`project`, `is_active`, `created_at`, `updated_at`), plus `users` (whose events it gets: the
creating key's users, null for an admin key) and, in the create answer only, `secret` (the
HMAC-SHA256 key of its deliveries' signatures, serve_app.ingress.webhook_delivery).
Event types are Mem0's `memory_add`, `memory_update`, `memory_delete` (its older spelling
`memory:add` is read as the same); any other is a 400 naming it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, model_validator

MAX_URL_CHARS = 2048
EVENT_TYPE_NAMES = ("memory_add", "memory_update", "memory_delete")


def _event_type(value: Any) -> Any:
    return value.replace(":", "_") if isinstance(value, str) else value


EventType = Annotated[str, BeforeValidator(_event_type), Field(pattern=r"^memory_(add|update|delete)$")]
EventTypes = Annotated[list[EventType], Field(min_length=1, max_length=len(EVENT_TYPE_NAMES))]


def _unique(types: list[str] | None) -> list[str] | None:
    return None if types is None else list(dict.fromkeys(types))


class CreateWebhookRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    url: str = Field(..., min_length=1, max_length=MAX_URL_CHARS, description="Where events are POSTed (http or https).")
    name: str = Field("", max_length=256)
    event_types: EventTypes = Field(list(EVENT_TYPE_NAMES), description="memory_add, memory_update, memory_delete.")

    @model_validator(mode="after")
    def _dedupe(self) -> "CreateWebhookRequest":
        self.event_types = _unique(self.event_types) or []
        return self


class UpdateWebhookRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    url: str | None = Field(None, min_length=1, max_length=MAX_URL_CHARS)
    name: str | None = Field(None, max_length=256)
    event_types: EventTypes | None = None
    is_active: StrictBool | None = None

    @model_validator(mode="after")
    def _something(self) -> "UpdateWebhookRequest":
        if self.url is None and self.name is None and self.event_types is None and self.is_active is None:
            raise ValueError("give url, name, event_types or is_active")
        self.event_types = _unique(self.event_types)
        return self

    def changes(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class Webhook(BaseModel):
    """A webhook as the routes answer it (module docstring)."""

    webhook_id: str
    name: str
    url: str
    owner: str
    event_types: list[str]
    project: str
    users: list[str] | None
    is_active: bool
    created_at: str
    updated_at: str
    secret: str | None = Field(None, description="Only in the create answer: the key of the deliveries' signatures.")

    @classmethod
    def of(cls, record: dict[str, Any], with_secret: bool = False) -> "Webhook":
        def iso(epoch: float) -> str:
            return datetime.fromtimestamp(epoch, tz=timezone.utc).isoformat()

        return cls(
            webhook_id=record["webhook_id"], name=record["name"], url=record["url"], owner=record["project"],
            event_types=record["event_types"], project=record["project"], users=record["users"], is_active=record["is_active"],
            created_at=iso(record["created_at"]), updated_at=iso(record["updated_at"]),
            secret=record["secret"] if with_secret else None,
        )
