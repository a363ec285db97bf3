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
