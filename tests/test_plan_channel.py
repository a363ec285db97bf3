"""The plan channel (actors.plan_channel): chat plans from the shard over a local ZeroMQ socket.

The protocol tests answer with a small planning function on a real PlanServer thread; the last
test runs the real shard actor (Ray, Redis, SmolLM2, MiniLM) and compares the channel's plans
with the ones Ray's call returns, across a shard restart.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

from actors.plan_channel import PlanChannelTimeout, PlanClient, PlanServer, plan_channel_address
from actors.shard_actor import ShardActor
from actors.shard_client import ShardClient, ShardTimeout
from memory.add_plan import AddBatch, AddCommit
from memory.chat_query import ChatQuery
from memory.planner import ChatPlan
from memory.shard import MemoryShard


def fresh_address() -> str:
    return plan_channel_address(f"/tmp/test-{uuid.uuid4().hex[:12]}")


def echo_plan(query: ChatQuery) -> ChatPlan:
    """A plan that says which query it answers; a user named "boom" gets an error."""
    if query.user_id == "boom":
        raise ValueError(f"no plan for {query.user_id}")
    return ChatPlan(prompt_token_ids=[len(query.user_id), query.top_k or 0], mode=query.mode, cache_salt=query.user_id)


def ask(user: str, k: int = 5, mode: str = "kv") -> ChatQuery:
    return ChatQuery(user_id=user, messages=[{"role": "user", "content": "hi"}], top_k=k, mode=mode)


@pytest.fixture()
def server():
    lock = threading.RLock()
    started = PlanServer(echo_plan, fresh_address(), lock).start()
    assert started.bound.is_set()
    yield started
    started.close()


def test_many_plans_in_flight_each_get_their_own_answer(server: PlanServer) -> None:
    async def main() -> list[ChatPlan]:
        client = PlanClient(server.address, timeout_s=10)
        try:
            return await asyncio.gather(*(client.plan(ask(f"user-{i}", k=i)) for i in range(64)))
        finally:
            client.close()

    plans = asyncio.run(main())
    assert [p.cache_salt for p in plans] == [f"user-{i}" for i in range(64)]
    assert [p.prompt_token_ids[1] for p in plans] == list(range(64))


def test_the_shards_error_is_raised_in_the_replica(server: PlanServer) -> None:
    async def main() -> None:
        client = PlanClient(server.address, timeout_s=10)
        try:
            with pytest.raises(ValueError, match="no plan for boom"):
                await client.plan(ask("boom"))
            assert (await client.plan(ask("dana"))).cache_salt == "dana"  # the channel goes on
        finally:
            client.close()

    asyncio.run(main())


def test_a_channel_nobody_serves_times_out() -> None:
    async def main() -> float:
        client = PlanClient(fresh_address(), timeout_s=0.3)
        started = time.perf_counter()
        try:
            with pytest.raises(PlanChannelTimeout):
                await client.plan(ask("dana"))
        finally:
            client.close()
        return time.perf_counter() - started

    assert asyncio.run(main()) < 2.0


def test_plans_wait_for_the_shards_lock(server: PlanServer) -> None:
    """While a Ray call holds the shard (its lock), a plan waits: one call at a time."""

    async def main() -> None:
        client = PlanClient(server.address, timeout_s=10)
        try:
            with server.lock:
                pending = asyncio.ensure_future(client.plan(ask("dana")))
                await asyncio.sleep(0.3)
                assert not pending.done()
            assert (await pending).cache_salt == "dana"
        finally:
            client.close()

    asyncio.run(main())


def test_a_restarted_shard_takes_the_address_over_and_the_client_reconnects() -> None:
    def tagged(tag: str):
        return lambda request: ChatPlan(prompt_token_ids=[], mode=tag, cache_salt=request.user_id)

    address = fresh_address()
    first = PlanServer(tagged("first"), address, threading.RLock()).start()

    async def main() -> None:
        client = PlanClient(address, timeout_s=10)
        try:
            assert (await client.plan(ask("dana"))).mode == "first"
            second = PlanServer(tagged("second"), address, threading.RLock()).start()  # the restarted shard
            try:
                first.close()  # the dead process's socket goes away
                # a request sent while the old connection dies may be lost (ShardClient then asks
                # through Ray); the client reaches the new shard within a few tries
                client.timeout_s = 1.0
                answered = None
                for _ in range(5):
                    try:
                        answered = await client.plan(ask("dana"))
                        break
                    except PlanChannelTimeout:
                        continue
                assert answered is not None and answered.mode == "second"
            finally:
                second.close()
        finally:
            client.close()

    try:
        asyncio.run(main())
    finally:
        first.close()


def test_the_channel_is_its_owners_only() -> None:
    import os
    import stat

    server = PlanServer(echo_plan, fresh_address(), threading.RLock()).start()
    try:
        mode = os.stat(server.address[len("ipc://"):]).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    finally:
        server.close()
    assert not os.path.exists(server.address[len("ipc://"):])  # closed: its file is gone


def test_a_stray_message_does_not_stop_the_channel(server: PlanServer) -> None:
    import zmq

    stray = zmq.Context.instance().socket(zmq.DEALER)
    stray.setsockopt(zmq.LINGER, 0)
    stray.connect(server.address)
    stray.send_multipart([b"only-one-frame-after-the-identity", b"x", b"y"])  # 4 frames at the server
    stray.close()

    async def main() -> str | None:
        client = PlanClient(server.address, timeout_s=10)
        try:
            return (await client.plan(ask("dana"))).cache_salt
        finally:
            client.close()

    assert asyncio.run(main()) == "dana"


def test_a_channel_that_does_not_answer_is_a_shard_timeout_not_a_second_plan_through_ray() -> None:
    """Asking again through Ray doubled a slow shard's work exactly when it was behind (issue 34)."""
    class Planner:
        calls = 0

        def plan_chat(self, query: ChatQuery) -> ChatPlan:
            Planner.calls += 1
            return echo_plan(query)

    client = ShardClient.in_process(Planner())
    client.plan_channel = PlanClient(fresh_address(), timeout_s=0.2)
    with pytest.raises(ShardTimeout, match="did not plan in time"):
        asyncio.run(client.plan_chat(ask("dana", k=7)))
    assert Planner.calls == 0


def test_a_plan_whose_client_gave_up_is_not_planned() -> None:
    """The shard was busy (its lock held) past the client's deadline: when the lock is free, the
    request is answered PlanExpired without planning, and the next request is planned as usual."""
    planned: list[str] = []

    def plan(query: ChatQuery) -> ChatPlan:
        planned.append(query.user_id)
        return echo_plan(query)

    lock = threading.RLock()
    running = PlanServer(plan, fresh_address(), lock).start()

    async def ask_once(user: str, timeout_s: float) -> ChatPlan:
        client = PlanClient(running.address, timeout_s)
        try:
            return await client.plan(ask(user))
        finally:
            client.close()

    try:
        with lock:  # a long call holds the shard
            with pytest.raises(PlanChannelTimeout):
                asyncio.run(ask_once("late", 0.3))
        assert asyncio.run(ask_once("dana", 10.0)).cache_salt == "dana"
    finally:
        running.close()
    assert planned == ["dana"] and running.expired == 1


def test_every_public_shard_method_but_the_probes_runs_under_the_lock() -> None:
    from actors.shard_actor import UNLOCKED

    public = [name for name in vars(MemoryShard) if not name.startswith("_") and callable(getattr(MemoryShard, name))]
    assert "plan_chat" in public and "commit_add" in public and UNLOCKED == {"health", "ready"}
    for name in public:
        if name in UNLOCKED:
            assert not hasattr(getattr(ShardActor, name), "shard_method"), name
        else:
            assert getattr(ShardActor, name).shard_method.__qualname__ in (f"MemoryShard.{name}", f"ShardActor.{name}"), name


@pytest.mark.slow
def test_the_shard_actor_plans_over_its_channel_as_over_ray_also_after_a_restart(smollm2_dir, redis_server) -> None:
    import ray

    from actors.shard_actor import start_shard_actor
    from memory.records import NewFact
    from tests.test_memory_shard import shard_settings

    settings = shard_settings(window_turns=0)
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    try:
        actor = start_shard_actor(0, settings, str(smollm2_dir), "float32", redis_server.url, uuid.uuid4().hex[:8])
        arena = ray.get(actor.ready.remote(), timeout=300)["arena"]
        over_ray = ShardClient(actor, timeout_s=60)
        over_channel = ShardClient(actor, timeout_s=60, plan_channel=PlanClient(plan_channel_address(arena), timeout_s=60))
        facts = ["Dana's dog is called Biscuit.", "Dana lives in Lisbon.", "Dana plays the cello.", "Sam likes tea."]

        async def plans() -> list[ChatPlan]:
            for text in facts:
                batch = AddBatch(user_id="sam" if text.startswith("Sam") else "dana", given=[NewFact(text=text)])
                await over_ray.commit_add(AddCommit(batch=batch))
            question = [{"role": "user", "content": "What is my dog called?"}]
            query = ChatQuery(user_id="dana", messages=question, top_k=2)
            return [await client.plan_chat(query) for client in (over_ray, over_channel)]

        def same(a: ChatPlan, b: ChatPlan) -> None:
            assert a.prompt_token_ids == b.prompt_token_ids and a.cache_salt == b.cache_salt
            assert [h.fact_id for h in a.facts] == [h.fact_id for h in b.facts] and len(a.facts) == 2
            assert "Sam likes tea." not in [h.text for h in a.facts]

        same(*asyncio.run(plans()))
        first_pid = ray.get(actor.ready.remote())["pid"]
        ray.kill(actor, no_restart=False)  # Ray restarts it; its channel is bound again by the new process
        deadline = time.monotonic() + 300
        while True:
            try:
                if ray.get(actor.ready.remote(), timeout=60)["pid"] != first_pid:
                    break
            except Exception:  # still restarting
                if time.monotonic() > deadline:
                    raise
        same(*asyncio.run(plans()))  # the facts were durable: the same plans, from the restarted shard
    finally:
        ray.shutdown()


def test_a_long_arena_path_gets_its_socket_in_a_folder_only_this_account_may_use(monkeypatch) -> None:
    """An arena path too long for a Unix socket puts the channel in `kvmem-<uid>` (0700, ours),
    which serves plans like any other address; a folder of that name that others may write (made
    by another account first) is refused with the reason, at the server's and the client's end."""
    import os
    import shutil
    import stat
    import tempfile
    from pathlib import Path

    tmp_path = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # short, as /run/user/<uid> is
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    address = plan_channel_address("/dev/shm/" + "a" * 120)
    folder = tmp_path / f"kvmem-{os.getuid()}"
    assert address == plan_channel_address("/dev/shm/" + "a" * 120)  # both ends compute the same one
    assert address.startswith(f"ipc://{folder}/kvmem-plan-") and len(address) - len("ipc://") <= 107
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    running = PlanServer(echo_plan, address, threading.RLock()).start()
    client = PlanClient(address, 5.0)

    async def plan_once() -> ChatPlan:
        try:
            return await client.plan(ask("alice"))
        finally:
            client.close()

    try:
        assert asyncio.run(plan_once()).cache_salt == "alice"
    finally:
        running.close()
    folder.chmod(0o777)  # as if another account had made it for everyone
    try:
        with pytest.raises(PermissionError, match="0700"):
            plan_channel_address("/dev/shm/" + "b" * 120)
    finally:
        shutil.rmtree(tmp_path)


def test_every_shard_call_the_client_makes_accepts_its_deadline() -> None:
    """ShardClient passes call_deadline to every call; Ray checks it against the signature in the
    caller (the probes included, which take no lock)."""
    import inspect

    public = [name for name in vars(MemoryShard) if not name.startswith("_") and callable(getattr(MemoryShard, name))]
    for name in public:
        assert "call_deadline" in inspect.signature(getattr(ShardActor, name)).parameters, name
