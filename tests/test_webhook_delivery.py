"""The webhook delivery by itself (serve_app.ingress.webhook_delivery), without Ray: real local HTTP
receivers (tests/test_webhooks.py's Receiver) get signed events; a 500 is retried with the same
event id, a 401 (the receiver's bad-signature refusal) is not; a full queue drops and says so; a
private target is refused before anything is sent unless allowed. The whole service's webhooks:
tests/test_webhooks.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve_app.ingress.webhook_delivery import DELIVERY_HEADER, Delivery, WebhookDelivery, target_refusal
from serve_app.webhook_settings import WebhookSettings
from tests.test_webhooks import Receiver

SECRET = "whsec_" + "a" * 64


def _delivery(url: str, event: str = "ADD") -> Delivery:
    return Delivery("wh_" + "1" * 24, url, SECRET, event, "f" * 32, "ann", None if event == "DELETE" else "Ann keeps bees.")


def _settings(**changes: object) -> WebhookSettings:
    return WebhookSettings(**{"allow_private_targets": True, "backoff_s": 0.05, "max_backoff_s": 0.2, "timeout_s": 2.0, **changes})


async def _settle(delivery: WebhookDelivery) -> None:
    await asyncio.wait_for(delivery.queue.join(), 10)


def test_signed_delivery_retry_and_bad_signature() -> None:
    ok, flaky, wrong = Receiver(), Receiver(fail_first=2), Receiver()
    ok.secret = flaky.secret = SECRET
    wrong.secret = "whsec_" + "b" * 64

    async def run() -> None:
        delivery = WebhookDelivery(_settings())
        for receiver in (ok, flaky, wrong):
            assert delivery.offer(_delivery(receiver.url))
        await _settle(delivery)

    try:
        asyncio.run(run())
        assert [(r["status"], r["signature_ok"]) for r in ok.received] == [(200, True)]
        assert json.loads(ok.received[0]["body"])["event_details"] == {
            "id": "f" * 32, "data": {"memory": "Ann keeps bees.", "user_id": "ann"}, "event": "ADD",
        }
        assert [r["status"] for r in flaky.received] == [500, 500, 200]  # retried, the same event each time
        assert len({r["headers"][DELIVERY_HEADER.lower()] for r in flaky.received}) == 1
        assert [(r["status"], r["signature_ok"]) for r in wrong.received] == [(401, False)]  # detected, not retried
    finally:
        for receiver in (ok, flaky, wrong):
            receiver.close()


def test_retries_are_bounded_and_a_full_queue_drops() -> None:
    down = Receiver(fail_first=100)

    async def run() -> list[bool]:
        delivery = WebhookDelivery(_settings(max_attempts=3, queue_size=1, workers=1))
        offered = [delivery.offer(_delivery(down.url)), delivery.offer(_delivery(down.url))]  # the worker has not taken one yet
        await _settle(delivery)
        return offered

    try:
        assert asyncio.run(run()) == [True, False]
        assert [r["status"] for r in down.received] == [500, 500, 500]  # max_attempts, then given up
    finally:
        down.close()


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/hook", "http://localhost/", "http://10.0.0.7/", "http://192.168.1.1/",
                                 "http://169.254.169.254/latest/meta-data/", "http://[::1]/", "http://[::ffff:127.0.0.1]/", "http://0.0.0.0/"])
def test_non_global_targets_are_refused_unless_allowed(url: str) -> None:
    assert "allow_private_targets" in (asyncio.run(target_refusal(url, False)) or "")
    assert asyncio.run(target_refusal(url, True)) is None


def test_a_private_target_is_not_sent_to_at_delivery_time() -> None:
    local = Receiver()

    async def run() -> None:
        delivery = WebhookDelivery(_settings(allow_private_targets=False))
        delivery.offer(_delivery(local.url, "DELETE"))
        await _settle(delivery)

    try:
        asyncio.run(run())
        assert local.received == []
    finally:
        local.close()


def test_urls_that_are_no_http_target_are_refused() -> None:
    for url in ("ftp://example.com/x", "http:///nohost", "http://user:pw@93.184.216.34/"):
        assert asyncio.run(target_refusal(url, True)) is not None
