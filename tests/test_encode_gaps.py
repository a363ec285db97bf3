"""The background encoder starts a batch in a gap between chats (serve_app.replica.encode_driver):
it waits while a chat is running at this moment, at most `memory.encode_gap_wait_s`, so chats
that never leave a gap slow the encodes and never starve them; 0 (the default, and GPUs) never
waits. No engine: only the wait is exercised here; tests/test_fairness.py runs the encoder's share
beside a chat on the real engine."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import yaml

from memory.settings import MemorySettings
from serve_app.replica.encode_driver import EncodeDriver
from serve_app.replica.scheduling import ChatsRunning

REPO = Path(__file__).resolve().parent.parent


def driver(chats: ChatsRunning, gap_wait_s: float) -> EncodeDriver:
    return EncodeDriver.for_memory(None, None, MemorySettings(encode_gap_wait_s=gap_wait_s), None, chats)  # type: ignore[arg-type]


def waited(gap_wait_s: float, chat_s: float | None) -> float:
    """Seconds a batch waited for its gap while a chat ran for `chat_s` (None: one that never ends)."""
    chats = ChatsRunning()
    encoder = driver(chats, gap_wait_s)

    async def run() -> float:
        async def one_chat() -> None:
            with chats.one():
                await asyncio.sleep(chat_s if chat_s is not None else 60.0)

        chat = asyncio.ensure_future(one_chat())
        await asyncio.sleep(0.05)
        assert chats.running_now()
        started = time.perf_counter()
        await encoder._wait_for_gap()
        took = time.perf_counter() - started
        chat.cancel()
        return took

    return asyncio.run(run())


def test_a_batch_waits_for_the_running_chat_to_end() -> None:
    assert 0.2 <= waited(2.0, chat_s=0.3) < 1.0


def test_chats_without_a_gap_delay_a_batch_only_so_long() -> None:
    assert 0.25 <= waited(0.3, chat_s=None) < 1.0


def test_no_wait_by_default_and_on_gpus() -> None:
    assert waited(0.0, chat_s=None) < 0.05
    gpu = yaml.safe_load((REPO / "config.gpu.yaml").read_text())["applications"][0]["args"]["memory"]
    assert MemorySettings(**gpu).encode_gap_wait_s == 0.0
    cpu = yaml.safe_load((REPO / "config.yaml").read_text())["applications"][0]["args"]["memory"]
    assert MemorySettings(**cpu).encode_gap_wait_s == 2.0  # what bench/results/flood_cpu.json measured
