"""Settings of the Mem0-style webhooks (the application's `args`: `webhooks`): where events may go,
how a delivery is bounded and retried. Read by serve_app.settings; imports no implementation.
The routes are serve_app.ingress.webhook_routes, the delivery serve_app.ingress.webhook_delivery.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class WebhookSettings(BaseModel):
    """Webhooks: memory events (memory_add, memory_update, memory_delete) POSTed, signed, to the URLs
    a key registered. Delivery runs in the ingress's background, never on the request's path: a
    bounded queue (an event past it is dropped and counted), a few workers, each POST bounded by
    `timeout_s`, retried with exponential backoff on a connection error, a timeout, 429 or 5xx."""

    model_config = ConfigDict(extra="forbid")

    allow_private_targets: bool = Field(
        False,
        description="Let webhooks target loopback, private, link-local and other non-global addresses. Off: every address a "
        "URL's host resolves to must be global, checked at create/update (400) and again before each delivery.",
    )
    timeout_s: float = Field(5.0, gt=0, le=60, description="Bound on one delivery POST (connect, send, answer).")
    max_attempts: int = Field(4, ge=1, le=10, description="Tries per event and webhook, the first included.")
    backoff_s: float = Field(0.5, ge=0, le=60, description="Wait before the first retry; doubled for each further one.")
    max_backoff_s: float = Field(30.0, ge=0, le=600, description="Cap on the wait between two tries.")
    queue_size: int = Field(1000, ge=1, le=1_000_000, description="Deliveries waiting at most; one more is dropped (counted).")
    workers: int = Field(4, ge=1, le=64, description="Deliveries in flight at once per ingress replica.")
    max_per_key: int = Field(20, ge=1, le=1000, description="Webhooks one API key (a project) may register.")
    cache_ttl_s: float = Field(
        2.0, ge=0, le=300, description="How long an ingress trusts its copy of the webhooks when matching events (its own "
        "changes are seen at once; another ingress replica's after this).",
    )

    @model_validator(mode="after")
    def _backoff_capped(self) -> "WebhookSettings":
        if self.max_backoff_s < self.backoff_s:
            raise ValueError("max_backoff_s must be at least backoff_s")
        return self
