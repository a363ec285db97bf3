"""Mem0's webhook routes (WebhookRoutes), and the memory events they are sent, for whichever deployment is the ingress.

    GET    /api/v1/webhooks/projects/{project_id}/   the project's webhooks (MemoryClient.get_webhooks)
    POST   /api/v1/webhooks/projects/{project_id}/   create one (create_webhook): url, name, event_types
    PUT    /api/v1/webhooks/{webhook_id}/            update it (update_webhook)
    DELETE /api/v1/webhooks/{webhook_id}/            delete it (delete_webhook)

Scope: a project is an API key (GET /v1/ping/ gives the key's id as `project_id`), so a key creates
webhooks in its own project only and reaches only its own project's (an admin key: any project's);
another project's id is a 403, another project's webhook the same 404 as one that does not exist.
A webhook gets the events of the users its key acted for when it was made (an admin key's: every
user's) and stops with its key (a revoked key's webhooks deliver nothing). A URL that resolves to a
loopback or private address is a 400 at create and update unless `webhooks.allow_private_targets`.

Events: after a memory write answers, ChatRoutes calls `_memory_events` (ADD, UPDATE, DELETE per
memory); the matching webhooks' deliveries are queued (serve_app.ingress.webhook_delivery) and sent
in the background. Records: memory.webhook_store (Redis, with the memories).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

from fastapi import Depends, HTTPException
from fastapi.exceptions import RequestValidationError

from memory.records import StoreUnavailable
from memory.webhook_store import WEBHOOK_ID_PATTERN, WebhookLimit, WebhookStore
from serve_app.ingress.auth import ANONYMOUS_ADMIN, SETTINGS_ADMIN, Principal, caller
from serve_app.ingress.errors import store_unavailable
from serve_app.ingress.routes import ChatRoutes, api
from serve_app.ingress.strict_routes import register
from serve_app.ingress.webhook_delivery import EVENT_TYPES, Delivery, WebhookDelivery, target_refusal
from serve_app.protocol import NotFound
from serve_app.webhook_protocol import CreateWebhookRequest, UpdateWebhookRequest, Webhook

PROJECT_WEBHOOKS = "/api/v1/webhooks/projects/{project_id}/"
ONE_WEBHOOK = "/api/v1/webhooks/{webhook_id}/"
logger = logging.getLogger(__name__)
ALWAYS_VALID_KEYS = frozenset({ANONYMOUS_ADMIN.key_id, SETTINGS_ADMIN.key_id})  # never stored, never revoked


def _bad_url(message: str) -> RequestValidationError:
    return RequestValidationError([{"type": "value_error", "loc": ("body", "url"), "msg": message, "input": None}])


def _not_found(webhook_id: str) -> HTTPException:
    message = f"no webhook {webhook_id!r}"
    error = HTTPException(404, message)
    error.__cause__ = NotFound(message, param="webhook_id", code="webhook_not_found")
    return error


class WebhookRoutes(ChatRoutes):
    """ChatRoutes plus Mem0's webhook routes and their deliveries (module docstring)."""

    _webhook_store: WebhookStore | None = None
    _webhook_delivery: WebhookDelivery | None = None
    _webhook_cache: tuple[float, list[dict[str, Any]]] | None = None
    _event_tasks: set[asyncio.Task[None]] = set()  # shared by design: one ingress object per process

    def _webhooks(self) -> WebhookStore:
        if self._webhook_store is None:
            settings = self.settings
            self._webhook_store = WebhookStore.from_url(
                settings.redis_url, settings.memory.redis_prefix, settings.webhooks.max_per_key, password=settings.redis_password_value()
            )
        return self._webhook_store

    def _delivery(self) -> WebhookDelivery:
        if self._webhook_delivery is None:
            self._webhook_delivery = WebhookDelivery(self.settings.webhooks)
        return self._webhook_delivery

    def _own_project(self, principal: Principal, project_id: str, creating: bool = False) -> None:
        """403 unless `project_id` is the caller's key (an admin key may read and change any project's)."""
        if project_id != principal.key_id and (creating or not principal.is_admin):
            raise HTTPException(403, f"this API key's project is {principal.key_id!r} (GET /v1/ping/), not {project_id!r}")

    async def _own_webhook(self, principal: Principal, webhook_id: str) -> dict[str, Any]:
        """The caller's webhook; one 404 for absent, another project's and an id never minted."""
        if not re.fullmatch(WEBHOOK_ID_PATTERN, webhook_id):
            raise _not_found(webhook_id)
        try:
            record = await self._webhooks().get(webhook_id)
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from exc
        if record is None or (record["project"] != principal.key_id and not principal.is_admin):
            raise _not_found(webhook_id)
        return record

    async def _check_target(self, url: str) -> None:
        refusal = await target_refusal(url, self.settings.webhooks.allow_private_targets)
        if refusal is not None:
            raise _bad_url(refusal)

    @register(api, "GET", PROJECT_WEBHOOKS)
    async def get_webhooks(self, project_id: str, principal: Principal = Depends(caller)) -> list[Webhook]:
        self._own_project(principal, project_id)
        try:
            return [Webhook.of(r) for r in await self._webhooks().of_project(project_id)]
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from exc

    @register(api, "POST", PROJECT_WEBHOOKS, status_code=201)
    async def create_webhook(self, project_id: str, request: CreateWebhookRequest, principal: Principal = Depends(caller)) -> Webhook:
        self._own_project(principal, project_id, creating=True)
        await self._check_target(request.url)
        users = None if principal.users is None else sorted(principal.users)
        try:
            record = await self._webhooks().create(principal.key_id, users, request.name, request.url, request.event_types)
        except WebhookLimit as exc:
            raise HTTPException(429, str(exc)) from exc
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from exc
        self._webhook_cache = None
        return Webhook.of(record, with_secret=True)

    @register(api, "PUT", ONE_WEBHOOK)
    async def update_webhook(self, webhook_id: str, request: UpdateWebhookRequest, principal: Principal = Depends(caller)) -> dict[str, Any]:
        await self._own_webhook(principal, webhook_id)
        if request.url is not None:
            await self._check_target(request.url)
        try:
            record = await self._webhooks().update(webhook_id, request.changes())
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from exc
        if record is None:
            raise _not_found(webhook_id)
        self._webhook_cache = None
        return {"message": "Webhook updated successfully", **Webhook.of(record).model_dump(exclude_none=True)}

    @register(api, "DELETE", ONE_WEBHOOK)
    async def delete_webhook(self, webhook_id: str, principal: Principal = Depends(caller)) -> dict[str, str]:
        record = await self._own_webhook(principal, webhook_id)
        try:
            deleted = await self._webhooks().delete(webhook_id, record["project"])
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from exc
        if not deleted:
            raise _not_found(webhook_id)
        self._webhook_cache = None
        return {"message": "Webhook deleted successfully"}

    # ------------------------------------------------------------------ events
    async def _active_webhooks(self) -> list[dict[str, Any]]:
        """Every active webhook whose key is still valid, cached for webhooks.cache_ttl_s."""
        now = time.monotonic()
        if self._webhook_cache is not None and now - self._webhook_cache[0] < self.settings.webhooks.cache_ttl_s:
            return self._webhook_cache[1]
        records = [r for r in await self._webhooks().every() if r["is_active"]]
        if records and self.settings.auth.mode == "keys":
            live = {k.key_id for k in await self.keys.list()} | ALWAYS_VALID_KEYS
            records = [r for r in records if r["project"] in live]
        self._webhook_cache = (now, records)
        return records

    async def _wants_events(self, user_id: str, event: str) -> bool:
        try:
            return any(self._matches(r, user_id, event) for r in await self._active_webhooks())
        except StoreUnavailable:
            return False

    @staticmethod
    def _matches(record: dict[str, Any], user_id: str, event: str) -> bool:
        return EVENT_TYPES[event] in record["event_types"] and (record["users"] is None or user_id in record["users"])

    def _memory_events(self, user_id: str, events: list[tuple[str, str, str | None]]) -> None:
        """Queues, in a background task, the deliveries of `events` ((ADD | UPDATE | DELETE, memory id,
        text)) of `user_id`'s memories to the webhooks that want them: nothing of it on the request's path."""
        events = [e for e in events if e[0] in EVENT_TYPES]
        if events:
            task = asyncio.get_running_loop().create_task(self._queue_events(user_id, events))
            self._event_tasks.add(task)
            task.add_done_callback(self._event_tasks.discard)

    async def _queue_events(self, user_id: str, events: list[tuple[str, str, str | None]]) -> None:
        try:
            webhooks = await self._active_webhooks()
        except StoreUnavailable as exc:
            logger.warning("memory events of %r not delivered: %s", user_id, exc)
            return
        delivery = self._delivery()
        for event, memory_id, text in events:
            for record in webhooks:
                if self._matches(record, user_id, event):
                    delivery.offer(Delivery(record["webhook_id"], record["url"], record["secret"], event, memory_id, user_id, text))
