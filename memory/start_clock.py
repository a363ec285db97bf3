"""Laps: the seconds of each phase of a start, in the order they ran (a shard's start phases)."""

from __future__ import annotations

import time


class Laps:
    """`lap(name)` records the seconds since the previous lap (or since the clock was made)."""

    def __init__(self) -> None:
        self.started = self._last = time.monotonic()
        self.phases: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.phases[f"{name}_s"] = round(now - self._last, 2)
        self._last = now

    def total(self) -> dict[str, float]:
        """The phases and their total."""
        return {**self.phases, "total_s": round(self._last - self.started, 2)}
