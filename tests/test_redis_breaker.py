"""memory.redis_breaker on a real redis-server that stops answering (SIGSTOP, as the fault bench
stops it): the first write waits its timeout, the next fail at once, all work again once Redis
answers; pipelines and transactions (every FactStore write) go through the same breaker."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from memory.fact_store import FactStore
from memory.records import NewFact
from memory.redis_breaker import RedisAway
from devtools.local_redis import LocalRedis

TIMEOUT_S = 1.0


@pytest.fixture()
def stoppable_redis(tmp_path_factory: pytest.TempPathFactory):
    with LocalRedis(tmp_path_factory.mktemp("breaker-redis")) as server:
        yield server


def _vec(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
    return v / np.linalg.norm(v)


def _timed(call) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - what each call raised is the point
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


def test_a_stopped_redis_costs_one_timeout_then_fails_fast_and_recovers(stoppable_redis: LocalRedis) -> None:
    store = FactStore.from_url(stoppable_redis.url, "brk", timeout_s=TIMEOUT_S)
    first, _ = store.add("ada", NewFact(text="Ada keeps bees."), _vec(0))
    pid = stoppable_redis.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        took, error = _timed(lambda: store.add("ada", NewFact(text="Ada rows on Sundays."), _vec(1)))
        assert error is not None and took >= TIMEOUT_S * 0.9  # the first write waits its timeout
        for i in range(5):  # then every command fails at once: a transaction, a read, a ping
            for call in (lambda: store.add("ada", NewFact(text=f"Ada fact {i}."), _vec(2 + i)),
                         lambda: store.get(first.fact_id), store.r.ping):
                took, error = _timed(call)
                assert isinstance(error, RedisAway) and took < 0.05, (took, error)
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 5
    while True:  # the breaker's own ping closes it within its probe interval
        took, error = _timed(store.r.ping)
        if error is None or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert error is None
    second, created = store.add("ada", NewFact(text="Ada rows on Sundays."), _vec(1))
    assert created and {r.fact_id for r in store.get_all("ada")} == {first.fact_id, second.fact_id}  # nothing half-written
