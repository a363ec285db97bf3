"""The background encoder starts a batch in a gap between chats (serve_app.replica.encode_driver):
it waits while a chat is running at this moment, and at most MAX_GAP_WAIT_S, so chats that never
leave a gap slow the encodes and never starve them. No engine: only the wait is exercised here;
tests/test_fairness.py runs the encoder's share beside a chat on the real engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.replica import encode_driver
from serve_app.replica.encode_driver import EncodeDriver
from serve_app.replica.scheduling import ChatsRunning


def test_a_batch_waits_for_the_running_chat_to_end() -> None:
    chats = ChatsRunning()
    driver = EncodeDriver(queue=None, engine=None, chats_running=chats)  # type: ignore[arg-type]

    async def run() -> float:
        async def one_chat() -> None:
            with chats.one():
                await asyncio.sleep(0.3)

        chat = asyncio.ensure_future(one_chat())
        await asyncio.sleep(0.05)
        assert chats.running_now()
        started = time.perf_counter()
        await driver._wait_for_gap()
        waited = time.perf_counter() - started
        await chat
        assert chats() and not chats.running_now()  # within the grace: still chatting, but in a gap
        return waited

    assert 0.2 <= asyncio.run(run()) < 1.0


def test_chats_without_a_gap_delay_a_batch_only_so_long(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encode_driver, "MAX_GAP_WAIT_S", 0.3)
    chats = ChatsRunning()
    driver = EncodeDriver(queue=None, engine=None, chats_running=chats)  # type: ignore[arg-type]

    async def run() -> float:
        with chats.one():  # never ends while the driver waits
            started = time.perf_counter()
            await driver._wait_for_gap()
            return time.perf_counter() - started

    assert 0.25 <= asyncio.run(run()) < 1.0
