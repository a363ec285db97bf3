"""EngineKeeper's stats line: vLLM's AsyncLLM.do_log_stats every engine.log_stats_interval_s while
the engine is up; never when the interval is 0 or the engine is dead. (Restarts are exercised
with the real engine in tests/test_faults.py; here only the keeper's own timing is under test.)"""

from __future__ import annotations

import asyncio

from serve_app.replica.lifecycle import EngineKeeper


class _Engine:
    """Just what the keeper reads of an AsyncLLM: `errored` and `do_log_stats`."""

    def __init__(self, errored: bool = False) -> None:
        self.errored = errored
        self.stats_logged = 0

    async def do_log_stats(self) -> None:
        self.stats_logged += 1


def _watched(engine: _Engine, interval_s: float, for_s: float = 0.5) -> int:
    async def run() -> int:
        keeper = EngineKeeper(engine, build=lambda: engine, restart_timeout_s=60, max_restarts=0, log_stats_interval_s=interval_s)
        keeper.watch(period_s=0.01)
        await asyncio.sleep(for_s)
        keeper.close()
        await asyncio.sleep(0.05)
        return engine.stats_logged

    return asyncio.run(run())


def test_the_engine_stats_line_is_logged_every_interval() -> None:
    assert 2 <= _watched(_Engine(), interval_s=0.1) <= 7


def test_no_stats_line_when_the_interval_is_zero_or_the_engine_is_dead() -> None:
    assert _watched(_Engine(), interval_s=0.0) == 0
    assert _watched(_Engine(errored=True), interval_s=0.1) == 0  # max_restarts=0: no restart is tried either


def test_with_other_replicas_of_the_shard_a_dead_engine_fails_health_at_once_and_is_not_rebuilt_here() -> None:
    """llm_replicas_per_shard > 1: Serve replaces the replica while the others answer; building an
    engine in the doomed replica would only take CPU and memory from them."""
    built = []

    async def run() -> tuple[str | None, str | None]:
        engine = _Engine()
        keeper = EngineKeeper(engine, build=lambda: built.append(1), restart_timeout_s=60, max_restarts=3, restart_in_place=False)
        keeper.watch(period_s=0.01)
        healthy = keeper.failure()
        engine.errored = True
        await asyncio.sleep(0.1)
        failed = keeper.failure()
        keeper.close()
        return healthy, failed

    healthy, failed = asyncio.run(run())
    assert healthy is None and failed is not None and "other replicas" in failed and built == []


def test_engines_on_one_card_start_one_at_a_time(tmp_path) -> None:
    """lifecycle.one_engine_start_at_a_time: a second start waits for the first (vLLM profiles the
    card's free memory while it starts), and a start waits at most its timeout."""
    import threading
    import time

    from serve_app.replica.lifecycle import one_engine_start_at_a_time

    spans: list[tuple[float, float]] = []

    def start() -> None:
        with one_engine_start_at_a_time(tmp_path, timeout_s=30):
            began = time.monotonic()
            time.sleep(0.3)
            spans.append((began, time.monotonic()))

    threads = [threading.Thread(target=start) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (a_start, a_end), (b_start, b_end) = sorted(spans)
    assert b_start >= a_end
    with one_engine_start_at_a_time(tmp_path, timeout_s=30):  # held: the next start gives up waiting after its timeout
        began = time.monotonic()
        with one_engine_start_at_a_time(tmp_path, timeout_s=0.5):
            waited = time.monotonic() - began
    assert 0.4 < waited < 5
