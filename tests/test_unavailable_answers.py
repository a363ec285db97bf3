"""What a caller is told while a part of the service is away: 503 with Retry-After, never a 500.

- a Redis error inside the shard actor leaves it as StoreUnavailable (actors.shard_actor), not as
  redis-py's own exception, which the ingress could only answer 500;
- the ingress maps StoreUnavailable, a shard that did not answer in time (ShardTimeout) and a
  replica that did not answer within replica_call_timeout_s to 503 with Retry-After.
The whole episode (Redis stopped under load) is tests/test_faults.py's.
"""

from __future__ import annotations

import asyncio

import pytest
from fastapi import HTTPException
from redis.exceptions import ConnectionError as RedisConnectionError

from actors.shard_actor import ShardActor
from actors.shard_client import ShardTimeout
from memory.records import StoreUnavailable
from memory.shard import MemoryShard
from serve_app.ingress import errors, routes


def test_a_redis_error_inside_the_shard_actor_leaves_it_as_store_unavailable() -> None:
    class Stub:  # only what the lock wrapper touches; the wrapped method is MemoryShard's own
        import threading

        lock = threading.RLock()
        busy = None

        class lease:  # noqa: N801 - the shard's ShardLease
            @staticmethod
            def touch() -> None:
                pass

        class store:  # noqa: N801 - the shard's FactStore, failing as a stopped Redis does
            @staticmethod
            def history(fact_id: str, user_id: str | None) -> list:
                raise RedisConnectionError("Timeout reading from socket")

    with pytest.raises(StoreUnavailable, match="memory store \\(Redis\\) unavailable: ConnectionError"):
        ShardActor.history(Stub(), "f1", "alice")
    assert ShardActor.history.shard_method is MemoryShard.history


@pytest.mark.parametrize(
    "error", [StoreUnavailable("memory store (Redis) unavailable: Timeout"), ShardTimeout("memory shard did not answer within 60 s")]
)
def test_the_ingress_answers_503_with_retry_after(error: Exception) -> None:
    answer = errors.http_error(error)
    assert answer is not None and answer.status_code == 503 and answer.headers == {"Retry-After": "5"}


def test_a_replica_that_does_not_answer_in_time_is_a_503() -> None:
    class Routes(routes.ChatRoutes):
        pass

    chat = Routes()
    chat.settings = type("S", (), {"replica_call_timeout_s": 0.05})()

    async def never() -> None:
        await asyncio.sleep(10)

    with pytest.raises(HTTPException) as raised:
        asyncio.run(chat._answer(never()))
    assert raised.value.status_code == 503 and raised.value.headers == {"Retry-After": "5"}


def test_a_dead_actor_is_a_503_with_retry_after() -> None:
    """Ray's ActorDiedError (a replica or shard killed mid-call) reaches the catch-all handler:
    the caller is told to come back, as for every other unavailable part."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from ray.exceptions import ActorDiedError

    from serve_app.ingress.errors import install_error_handlers

    api = FastAPI()
    install_error_handlers(api)

    @api.get("/dead")
    def dead() -> None:
        raise ActorDiedError()

    answer = TestClient(api, raise_server_exceptions=False).get("/dead")
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "5"
    assert answer.json()["error"]["type"] == "server_error"


def test_no_vllm_exception_leaves_the_replica() -> None:
    """A dead engine's exception crossing into the ingress made it import vLLM to unpickle it (11 s
    of a stalled event loop on the CPU); the replica turns it into EngineUnavailable naming itself,
    which the ingress answers 503 and a chat fails over on."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from serve_app.protocol import EngineUnavailable
    from serve_app.replica.sampling import engine_errors_as_ours

    with pytest.raises(EngineUnavailable) as raised:
        with engine_errors_as_ours("replica-7"):
            raise EngineDeadError()
    assert raised.value.replica_id == "replica-7" and raised.value.__cause__ is None
    answer = errors.http_error(raised.value)
    assert answer is not None and answer.status_code == 503 and answer.headers == {"Retry-After": "5"}
    import pickle

    again = pickle.loads(pickle.dumps(raised.value))  # crosses Ray as it is
    assert isinstance(again, EngineUnavailable) and again.replica_id == "replica-7"
