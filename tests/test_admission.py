"""Admission, before a body is read (issue 36), checked without starting the service.

- token buckets per user (a key bound to one user) and per key (a key of several users, then
  each user it names), in-flight caps per key, Retry-After that says when, admin keys not limited;
- a key that calls again before its Retry-After has its refusal held, a bounded number at once;
- several ingress processes: a key active in n of them gets 1/n of its limits in each;
- through the RequestGate: a refusal is answered without one receive() of the body, and the
  in-flight slot is freed when the request is answered.
The same through the running service, and what it costs another tenant: tests/test_hostile_serve.py
and bench/serve/tenants_flood.py --hostile at commit 631086d (retired in issue 35; docs/hostile.md).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from memory.key_store import Principal
from serve_app.client_limits import AdmissionSettings, KeyLimits, RateLimit, UserLimits
from serve_app.ingress.admission import Admission, Refused, request_class

BEA = Principal("key_00000000bea", frozenset({"bea"}))
APP = Principal("key_000000000app", frozenset({"u1", "u2", "u3"}))
ADMIN = Principal("admin-settings", None)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock() -> Clock:
    return Clock()


def limits(chats: tuple[float, int] = (1.0, 3), writes: tuple[float, int] = (1.0, 2), reads: tuple[float, int] = (5.0, 5)) -> UserLimits:
    return UserLimits(chats=RateLimit(per_s=chats[0], burst=chats[1]), writes=RateLimit(per_s=writes[0], burst=writes[1]),
                      reads=RateLimit(per_s=reads[0], burst=reads[1]))


def settings(**changes: Any) -> AdmissionSettings:
    return AdmissionSettings(**({"per_user": limits(), "per_key": KeyLimits(**limits(chats=(10.0, 6)).model_dump())} | changes))


def admit_all(admission: Admission, principal: Principal, kind: str, n: int, connection: str | None = "127.0.0.1:5000") -> list[Refused | None]:
    outcomes: list[Refused | None] = []
    for _ in range(n):
        try:
            admission.release(admission.admit(principal, kind, connection))  # answered at once: no in-flight build-up
            outcomes.append(None)
        except Refused as refused:
            outcomes.append(refused)
    return outcomes


@pytest.mark.parametrize("method, path, kind", [
    ("POST", "/v1/chat/completions", "chats"), ("POST", "/v1/completions", "chats"), ("POST", "/v1/memories/", "writes"),
    ("POST", "/v3/memories/add/", "writes"), ("PUT", "/v1/memories/abc", "writes"), ("DELETE", "/v1/memories", "writes"),
    ("GET", "/v1/memories", "reads"), ("POST", "/v1/memories/search", "reads"), ("POST", "/v3/memories/", "reads"),
    ("GET", "/v1/nothing-here", "reads"),
])
def test_every_route_has_a_class(method: str, path: str, kind: str) -> None:
    assert request_class(method, path) == kind


def test_a_users_burst_is_admitted_then_refused_with_when_to_come_back(clock: Clock) -> None:
    admission = Admission(settings(), clock=clock)
    outcomes = admit_all(admission, BEA, "chats", 4)
    assert outcomes[:3] == [None, None, None]
    refused = outcomes[3]
    assert isinstance(refused, Refused) and refused.code == "rate_limited"
    assert refused.retry_after_s == 1 and refused.headers()["Retry-After"] == "1"
    assert "user 'bea'" in refused.message and "admission.per_user.chats" in refused.message
    assert admit_all(admission, BEA, "writes", 1) == [None]  # another class: its own bucket
    clock.now += 1.0  # one token back
    assert admit_all(admission, BEA, "chats", 2)[0] is None


def test_retry_after_says_how_long_until_a_token(clock: Clock) -> None:
    admission = Admission(AdmissionSettings(per_user=limits(chats=(0.25, 1))), clock=clock)
    assert admit_all(admission, BEA, "chats", 1) == [None]
    clock.now += 1.0  # a quarter of a token back: three quarters at 0.25/s = 3 s
    (refused,) = admit_all(admission, BEA, "chats", 1)
    assert refused is not None and refused.retry_after_s == 3


def test_admin_keys_are_not_limited(clock: Clock) -> None:
    admission = Admission(settings(), clock=clock)
    assert admit_all(admission, ADMIN, "chats", 50) == [None] * 50
    admission = Admission(settings(enabled=False), clock=clock)
    assert admit_all(admission, BEA, "chats", 50) == [None] * 50


def test_a_key_of_several_users_spends_its_own_buckets_then_each_users(clock: Clock) -> None:
    admission = Admission(settings(), clock=clock)
    assert admit_all(admission, APP, "chats", 6) == [None] * 6  # per_key burst 6, not per_user 3
    assert isinstance(admit_all(admission, APP, "chats", 1)[0], Refused)
    clock.now += 10
    for _ in range(3):
        admission.admit_user(APP, "u1", "chats")
    with pytest.raises(Refused, match="user 'u1'"):
        admission.admit_user(APP, "u1", "chats")
    admission.admit_user(APP, "u2", "chats")  # another user of the same key
    admission.admit_user(BEA, "bea", "chats")  # a key of one user spent its user's bucket in admit(): no-op here
    admission.admit_user(ADMIN, "u1", "chats")  # admin: not limited


def test_a_users_buckets_are_the_same_whichever_key_acts_for_the_user(clock: Clock) -> None:
    admission = Admission(settings(), clock=clock)
    both = Principal("key_000000000two", frozenset({"bea", "cal"}))
    assert admit_all(admission, BEA, "chats", 3) == [None] * 3
    with pytest.raises(Refused):
        admission.admit_user(both, "bea", "chats")


def test_running_requests_of_a_key_are_capped(clock: Clock) -> None:
    admission = Admission(settings(max_engine_requests_per_key=2, per_user=limits(chats=(100.0, 100))), clock=clock)
    tickets = [admission.admit(BEA, "chats") for _ in range(2)]
    with pytest.raises(Refused) as refused:
        admission.admit(BEA, "chats")
    assert refused.value.code == "too_many_requests_in_flight" and "max_engine_requests_per_key" in refused.value.message
    admission.admit(BEA, "reads")  # reads are not capped
    admission.release(tickets[0])
    admission.release(tickets[0])  # twice: counted once
    tickets.append(admission.admit(BEA, "chats"))  # one slot was free again
    clock.now += 2.0
    with pytest.raises(Refused) as first:
        admission.admit(BEA, "chats")
    assert first.value.hold_s == 0  # told to retry in a second: answered at once
    clock.now += 0.2
    with pytest.raises(Refused) as again:
        admission.admit(BEA, "chats")
    assert again.value.hold_s > 0  # back within that second: held
    app = Admission(settings(max_engine_requests_per_key=1, max_engine_requests_per_shared_key=3,
                             per_key=KeyLimits(chats=RateLimit(per_s=100.0, burst=100))), clock=clock)
    running = [app.admit(APP, "chats") for _ in range(3)]  # a key of several users: its own cap
    with pytest.raises(Refused, match="max_engine_requests_per_shared_key"):
        app.admit(APP, "chats")
    assert len(running) == 3


def test_a_key_that_ignores_retry_after_is_held_a_bounded_number_at_once(clock: Clock) -> None:
    admission = Admission(AdmissionSettings(per_user=limits(chats=(0.5, 1)), refusal_hold_s=1.5, max_held_per_key=1), clock=clock)
    admit_all(admission, BEA, "chats", 1)
    (first,) = admit_all(admission, BEA, "chats", 1)
    assert first is not None and first.hold_s == 0 and first.retry_after_s == 2  # told 2 s: answered at once
    clock.now += 0.5  # back early
    (second,) = admit_all(admission, BEA, "chats", 1)
    # the early call cost a token: 0.25 - 1 = -0.75 tokens, 3.5 s to one token, 1.5 of them held
    assert second is not None and second.hold_s == 1.5 and not second.close and second.retry_after_s == 2

    async def while_one_is_held() -> Refused:
        async with admission.held(BEA.key_id):
            (third,) = admit_all(admission, BEA, "chats", 1)
            assert third is not None
            return third

    third = asyncio.run(while_one_is_held())
    assert third.hold_s == 0 and third.close and third.headers()["Connection"] == "close"
    clock.now += 10  # waited as told: admitted
    assert admit_all(admission, BEA, "chats", 1) == [None]


class Spread:
    def __init__(self, processes: int) -> None:
        self.n, self.noted = processes, set()

    def processes(self, key_id: str) -> int:
        return self.n

    def note(self, key_id: str) -> None:
        self.noted.add(key_id)


def test_a_key_spread_over_processes_gets_its_share_in_each(clock: Clock) -> None:
    spread = Spread(2)
    admission = Admission(AdmissionSettings(per_user=limits(chats=(2.0, 4))), spread, clock=clock)
    outcomes = admit_all(admission, BEA, "chats", 3)
    assert outcomes[:2] == [None, None] and isinstance(outcomes[2], Refused)  # a burst of 4 over 2 processes
    assert spread.noted == {BEA.key_id}
    clock.now += 1.0  # 2 a second over 2 processes: one token a second here
    outcomes = admit_all(admission, BEA, "chats", 2)
    assert outcomes[0] is None and isinstance(outcomes[1], Refused)
    admission = Admission(AdmissionSettings(per_user=limits(chats=(100.0, 100)), max_engine_requests_per_key=4), spread, clock=clock)
    running = [admission.admit(BEA, "chats") for _ in range(2)]  # a cap of 4 over 2 processes
    with pytest.raises(Refused, match="at most 4"):
        admission.admit(BEA, "chats")
    assert len(running) == 2


# ------------------------------------------------------------------------------ through the gate
class Downstream:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope, receive, send) -> None:
        self.calls += 1
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


class Keys:
    async def revoke_settings_copies(self) -> int:
        return 0

    async def principal(self, key: str) -> Principal | None:
        return BEA if key == "kvm-bea" else None


def gate(admission: Admission, body_timeout_s: float = 5.0) -> tuple[Any, Downstream, Any]:
    from serve_app.ingress.auth import Authenticator
    from serve_app.ingress.gate import RequestGate
    from serve_app.settings import AuthSettings

    downstream = Downstream()
    ingress = SimpleNamespace(auth=Authenticator(AuthSettings(mode="keys"), Keys()), admission=admission,
                              max_body_bytes=10_000, body_timeout_s=body_timeout_s, max_json_depth=32)
    return RequestGate(downstream, lambda: ingress), downstream, ingress


async def call(app: Any, path: str, body: bytes | None, stall: bool = False) -> tuple[int, dict[str, str], int]:
    """(status, response headers, receive() calls made) of one POST through `app`."""
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"",
             "headers": [(b"authorization", b"Bearer kvm-bea"), (b"content-length", str(len(body or b"")).encode())]}
    received = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        if stall:
            await asyncio.sleep(3600)
        return {"type": "http.request", "body": body or b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers, received


def test_the_gate_refuses_before_reading_the_body_and_frees_the_slot(clock: Clock) -> None:
    admission = Admission(AdmissionSettings(per_user=limits(chats=(1.0, 2)), max_engine_requests_per_key=5), clock=clock)
    app, downstream, _ = gate(admission)

    async def run() -> list[tuple[int, dict[str, str], int]]:
        return [await call(app, "/v1/chat/completions", b"{}") for _ in range(3)]

    answers = asyncio.run(run())
    assert [a[0] for a in answers] == [200, 200, 429] and downstream.calls == 2
    status, headers, received = answers[2]
    assert received == 0 and headers["retry-after"] == "1"
    assert not admission._running  # the two answered requests gave their slots back


def test_a_stalled_body_is_answered_408_and_closed_by_its_deadline(clock: Clock) -> None:
    admission = Admission(AdmissionSettings(), clock=clock)
    app, downstream, _ = gate(admission, body_timeout_s=0.3)
    status, headers, received = asyncio.run(call(app, "/v1/memories", b"{}", stall=True))
    assert (status, headers.get("connection"), downstream.calls) == (408, "close", 0)
    assert not admission._running


def test_a_deep_body_is_refused_naming_the_field_before_parsing(clock: Clock) -> None:
    app, downstream, _ = gate(Admission(AdmissionSettings(per_user=limits(writes=(100.0, 100))), clock=clock))
    deep = b'{"user_id": "bea", "facts": ["x"], "metadata": {"a": ' + b"[" * 1000 + b"1" + b"]" * 1000 + b"}}"
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        scope = {"type": "http", "method": "POST", "path": "/v1/memories", "root_path": "", "query_string": b"",
                 "headers": [(b"authorization", b"Bearer kvm-bea")]}

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": deep, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(scope, receive, send)

    asyncio.run(run())
    import json

    error = json.loads(sent[1]["body"])["error"]
    assert sent[0]["status"] == 400 and downstream.calls == 0
    assert error["code"] == "nested_too_deep" and error["param"].startswith("metadata.a.0")
    assert "1002 levels" in error["message"] and "at most 32" in error["message"]


def test_an_address_that_keeps_calling_without_a_key_is_held(clock: Clock) -> None:
    admission = Admission(AdmissionSettings(refusal_hold_s=1.0, max_held_per_key=1), clock=clock)
    assert admission.unauthenticated_hold("10.0.0.1") == 0.0  # the first 401: at once
    clock.now += 0.2
    assert admission.unauthenticated_hold("10.0.0.1") == 1.0  # again at once: held
    assert admission.unauthenticated_hold("10.0.0.2") == 0.0  # another address: its own
    clock.now += 5.0
    assert admission.unauthenticated_hold("10.0.0.1") == 0.0  # after a quiet spell: at once again

    async def while_one_is_held() -> float:
        async with admission.held("address:10.0.0.1"):
            clock.now += 0.1
            return admission.unauthenticated_hold("10.0.0.1")

    assert asyncio.run(while_one_is_held()) == 0.0  # past max_held_per_key: at once


def test_a_client_that_keeps_calling_while_refused_never_gets_through_one_that_waits_does(clock: Clock) -> None:
    admission = Admission(AdmissionSettings(per_user=limits(chats=(1.0, 5))), clock=clock)
    assert admit_all(admission, BEA, "chats", 5) == [None] * 5  # the burst
    for _ in range(60):  # then a call a second (each refusal held about that long): as fast as it is answered
        (refused,) = admit_all(admission, BEA, "chats", 1)
        assert refused is not None
        clock.now += max(refused.hold_s, 0.5)
    assert refused.retry_after_s >= 1
    clock.now += refused.retry_after_s  # waits as told, once
    assert admit_all(admission, BEA, "chats", 1) == [None]
    other = Principal("key_000000000cal", frozenset({"cal"}))
    assert admit_all(admission, other, "chats", 5) == [None] * 5  # another user never noticed


def test_connections_that_wait_as_told_are_not_charged_for_each_other(clock: Clock) -> None:
    admission = Admission(AdmissionSettings(per_user=limits(chats=(1.0, 2))), clock=clock)
    admitted = 0
    told = {f"127.0.0.1:{port}": 0.0 for port in range(5000, 5008)}  # eight connections of one user
    for _ in range(300):  # 30 s in steps of 0.1 s; each connection calls when it was told it may
        clock.now += 0.1
        for connection, at in told.items():
            if clock.now >= at:
                try:
                    admission.release(admission.admit(BEA, "chats", connection))
                    admitted += 1
                except Refused as refused:
                    told[connection] = clock.now + refused.hold_s + refused.retry_after_s
    assert 22 <= admitted <= 32  # about the rate (1 a second, a burst of 2), never starved by debt


def test_a_connection_looping_on_the_in_flight_cap_pays_tokens_and_one_that_waits_does_not(clock: Clock) -> None:
    """Two processes of one key (one chat at once): the second, sending again as soon as its 429
    comes back, spends the key's chat tokens as a rate refusal's debt would, so the first one's
    chats stop running back to back; a second process that waits as told costs nothing."""
    def looping(second: str, wait_s: float) -> tuple[int, Refused | None]:
        # chats: one token in 10 s, bursts of 3, one at once: six early calls would leave the bucket in debt
        admission = Admission(settings(per_user=limits(chats=(0.1, 3))), clock=clock)
        first = admission.admit(BEA, "chats", "10.0.0.1:1000")
        refusals = 0
        for _ in range(6):
            with pytest.raises(Refused) as refused:
                admission.admit(BEA, "chats", second)
            assert refused.value.code == "too_many_requests_in_flight"
            refusals += 1
            clock.now += refused.value.hold_s + wait_s
        admission.release(first)
        try:
            admission.release(admission.admit(BEA, "chats", "10.0.0.1:1000"))
            return refusals, None
        except Refused as rate:
            return refusals, rate

    refusals, after = looping("10.0.0.1:2000", wait_s=0.0)  # ignores Retry-After
    assert refusals == 6 and after is not None and after.code == "rate_limited"  # the key's bucket is in debt
    refusals, after = looping("10.0.0.1:3000", wait_s=1.0)  # waits the second it was told: charged nothing
    assert refusals == 6 and after is None
