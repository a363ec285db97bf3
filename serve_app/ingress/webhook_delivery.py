"""Webhook delivery: memory events POSTed, signed, to the webhooks' URLs, off the request's path.

- Targets: an http(s) URL whose host resolves only to global addresses (not loopback, private,
  link-local, shared, reserved, multicast or unspecified; IPv4-mapped IPv6 judged as its IPv4),
  every address checked, at create/update (serve_app.ingress.webhook_routes answers 400) and again
  before each try (a name may resolve elsewhere later). `webhooks.allow_private_targets` lifts it.
  Redirects are never followed (a 3xx is a failed try), and no proxy from the environment is used.
- Signature: `X-KVMem-Signature: sha256=<hex>`, the HMAC-SHA256 under the webhook's secret (given
  once, at create) of `<X-KVMem-Timestamp>.<body>`; `verify_signature` is the receiver's check.
  `X-KVMem-Event` names the event type, `X-KVMem-Delivery` the event (the same on every retry).
- Body: Mem0's `{"event_details": {"id", "data": {"memory", "user_id"}, "event": ADD|UPDATE|DELETE}}`,
  plus `event_type`, `event_id`, `webhook_id` and `created_at`. A DELETE carries no text (erased).
- Queue: `offer` only enqueues (never awaits the network); a full queue (`webhooks.queue_size`)
  drops the delivery and counts it. `webhooks.workers` tasks deliver; each POST is bounded by
  `timeout_s`; a connection error, a timeout, 408, 429 or 5xx is retried after `backoff_s` doubled
  per try (at most `max_backoff_s`), `max_attempts` tries in all; another answer ends it.
  Deliveries queued in an ingress replica that dies are lost (at most once).
- Metrics: kvmem_webhook_deliveries_total{outcome: delivered | failed | dropped | refused_target},
  kvmem_webhook_retries_total.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from ray.serve.metrics import Counter

from serve_app.webhook_settings import WebhookSettings

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-KVMem-Signature"
TIMESTAMP_HEADER = "X-KVMem-Timestamp"
EVENT_HEADER = "X-KVMem-Event"
DELIVERY_HEADER = "X-KVMem-Delivery"
RESOLVE_TIMEOUT_S = 5.0
EVENT_TYPES = {"ADD": "memory_add", "UPDATE": "memory_update", "DELETE": "memory_delete"}


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """The X-KVMem-Signature value of a delivery (module docstring)."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def verify_signature(secret: str, timestamp: str, body: bytes, header: str | None) -> bool:
    """What a receiver checks: the header is the signature of this timestamp and body under `secret`."""
    return header is not None and hmac.compare_digest(signature(secret, timestamp, body), header)


def _not_global(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_global or ip.is_multicast


async def target_refusal(url: str, allow_private: bool) -> str | None:
    """Why `url` may not receive webhooks (None: it may): its scheme, no host, a host that does not
    resolve, or (unless `allow_private`) any address of it that is not global."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        return f"url: not a URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return "url: the scheme must be http or https"
    if not host:
        return "url: no host"
    if parts.username or parts.password:
        return "url: credentials in the URL are not accepted"
    if allow_private:
        return None
    try:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(host, port or (443 if parts.scheme == "https" else 80), type=socket.SOCK_STREAM),
            RESOLVE_TIMEOUT_S,
        )
    except (OSError, asyncio.TimeoutError) as exc:
        return f"url: the host {host!r} does not resolve ({type(exc).__name__})"
    private = sorted({str(info[4][0]) for info in infos if _not_global(str(info[4][0]))})
    if private or not infos:
        return (
            f"url: the host {host!r} resolves to {', '.join(private) or 'nothing'}: loopback, private and other non-global "
            "addresses may not receive webhooks (webhooks.allow_private_targets)"
        )
    return None


@dataclass
class Delivery:
    """One event for one webhook."""

    webhook_id: str
    url: str
    secret: str
    event: str  # ADD | UPDATE | DELETE
    memory_id: str
    user_id: str
    memory: str | None
    event_id: str = field(default_factory=lambda: f"evt_{uuid.uuid4().hex}")
    created_at: float = field(default_factory=time.time)

    def body(self) -> bytes:
        payload: dict[str, Any] = {
            "event_details": {"id": self.memory_id, "data": {"memory": self.memory, "user_id": self.user_id}, "event": self.event},
            "event_type": EVENT_TYPES[self.event], "event_id": self.event_id, "webhook_id": self.webhook_id,
            "created_at": self.created_at,
        }
        return json.dumps(payload, separators=(",", ":")).encode()


class WebhookDelivery:
    """The ingress replica's delivery queue and workers (module docstring); started on first use."""

    def __init__(self, settings: WebhookSettings) -> None:
        self.settings = settings
        self.queue: asyncio.Queue[Delivery] = asyncio.Queue(maxsize=settings.queue_size)
        self._workers: list[asyncio.Task[None]] = []
        self._client: httpx.AsyncClient | None = None
        self.deliveries = Counter(
            "kvmem_webhook_deliveries_total", description="Webhook deliveries by outcome.", tag_keys=("outcome",)
        )
        self.retries = Counter("kvmem_webhook_retries_total", description="Webhook delivery tries after a failed one.")

    def offer(self, delivery: Delivery) -> bool:
        """Queues a delivery without waiting; False (and counted as dropped) when the queue is full."""
        self._start()
        try:
            self.queue.put_nowait(delivery)
        except asyncio.QueueFull:
            self.deliveries.inc(1, tags={"outcome": "dropped"})
            logger.warning("webhook queue full (%d): event %s for %s dropped", self.settings.queue_size, delivery.event_id, delivery.webhook_id)
            return False
        return True

    def _start(self) -> None:
        if self._workers:
            return
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.settings.timeout_s), follow_redirects=False, trust_env=False)
        self._workers = [asyncio.get_running_loop().create_task(self._work()) for _ in range(self.settings.workers)]

    async def _work(self) -> None:
        while True:
            delivery = await self.queue.get()
            try:
                outcome = await self._deliver(delivery)
            except Exception:  # noqa: BLE001 - a worker never dies of one delivery
                logger.exception("webhook delivery %s failed unexpectedly", delivery.event_id)
                outcome = "failed"
            finally:
                self.queue.task_done()
            self.deliveries.inc(1, tags={"outcome": outcome})

    async def _deliver(self, delivery: Delivery) -> str:
        """Tries a delivery up to max_attempts times; its outcome."""
        settings = self.settings
        body = delivery.body()
        assert self._client is not None
        for attempt in range(settings.max_attempts):
            if attempt:
                self.retries.inc(1)
                await asyncio.sleep(min(settings.backoff_s * 2 ** (attempt - 1), settings.max_backoff_s))
            refusal = await target_refusal(delivery.url, settings.allow_private_targets)
            if refusal is not None:  # resolves elsewhere now: never sent there
                logger.warning("webhook %s not delivered: %s", delivery.webhook_id, refusal)
                return "refused_target"
            timestamp = str(int(time.time()))
            headers = {
                "Content-Type": "application/json", TIMESTAMP_HEADER: timestamp, EVENT_HEADER: EVENT_TYPES[delivery.event],
                DELIVERY_HEADER: delivery.event_id, SIGNATURE_HEADER: signature(delivery.secret, timestamp, body),
                "User-Agent": "kv-memory-serve-webhooks",
            }
            try:
                answer = await self._client.post(delivery.url, content=body, headers=headers)
            except httpx.HTTPError as exc:
                logger.info("webhook %s try %d: %s", delivery.webhook_id, attempt + 1, type(exc).__name__)
                continue
            if 200 <= answer.status_code < 300:
                return "delivered"
            logger.info("webhook %s try %d: HTTP %d", delivery.webhook_id, attempt + 1, answer.status_code)
            if answer.status_code not in (408, 429) and answer.status_code < 500:
                return "failed"  # the receiver refused it (a bad signature, a 3xx, ...): trying again changes nothing
        return "failed"
