"""The hostile clients of bench/serve/tenants_flood.py (issue 36) and what the other tenant sees.
The clients: docs/bench.md."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.kit.results import percentiles

QUESTION = "What does Bea keep in the blue tin?"


def chat_body(user: str, max_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": QUESTION}], "user": user, "max_tokens": max_tokens, "memory": {"mode": "kv"}}


def quantiles(values: list[float]) -> dict[str, float | int | None]:
    return {"n": len(values), **percentiles(values, (50, 95), unit="_s"), "max_s": round(max(values), 3) if values else None}


# ------------------------------------------------------------------------------ the flood
def _flood_loop(url: str, key: str, user: str, what: str, stop_at: float, max_tokens: int, out: dict[str, Any]) -> None:
    statuses: Counter[str] = Counter()
    seconds: dict[str, list[float]] = {}
    headers = {"Authorization": f"Bearer {key}"}
    n = 0
    with httpx.Client(base_url=url, timeout=120, headers=headers) as client:
        while time.time() < stop_at:
            n += 1
            if what == "chats":
                body, path = chat_body(user, max_tokens), "/v1/chat/completions"
            else:
                body, path = {"user_id": user, "facts": [f"Ann's note {n}-{i}: shelf {i} holds {n} red boxes." for i in range(4)]}, "/v1/memories"
            started = time.perf_counter()
            try:
                status = str(client.post(path, json=body).status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            statuses[status] += 1
            seconds.setdefault(status, []).append(time.perf_counter() - started)
    out[what] = {"statuses": dict(statuses), "seconds_by_status": {s: quantiles(v) for s, v in seconds.items()}, "requests": n}


def flood_process(url: str, key: str, user: str, stop_at: float, max_tokens: int, results: Any,
                  loops_of: tuple[str, ...] = ("chats", "adds")) -> None:
    """One flooding process: a chat loop and an add loop (or those `loops_of` names), until `stop_at` (epoch s)."""
    out: dict[str, Any] = {}
    loops = [threading.Thread(target=_flood_loop, args=(url, key, user, what, stop_at, max_tokens, out)) for what in loops_of]
    for loop in loops:
        loop.start()
    for loop in loops:
        loop.join()
    results.put(out)


class FloodProcesses:
    """`processes` spawned flooding processes of one key (module docstring)."""

    def __init__(self, url: str, key: str, user: str, processes: int, seconds: float, max_tokens: int,
                 loops_of: tuple[str, ...] = ("chats", "adds")) -> None:
        context = mp.get_context("spawn")
        self.results = context.Queue()
        self.stop_at = time.time() + seconds
        self.procs = [context.Process(target=flood_process, args=(url, key, user, self.stop_at, max_tokens, self.results, loops_of))
                      for _ in range(processes)]

    def start(self) -> "FloodProcesses":
        for proc in self.procs:
            proc.start()
        return self

    def join(self) -> list[dict[str, Any]]:
        outs = [self.results.get(timeout=300) for _ in self.procs]
        for proc in self.procs:
            proc.join(30)
        return outs


# ------------------------------------------------------------------------------ stalled connections
class StalledConnections:
    """`count` connections stalled in their body at all times until stopped (module docstring)."""

    def __init__(self, url: str, key: str, count: int) -> None:
        where = urlsplit(url)
        self.address = (where.hostname, where.port)
        self.request = (b"POST /v1/memories HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer " + key.encode()
                        + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + b'{"user_id"')
        self.count = count
        self.closed: list[dict[str, Any]] = []  # per connection: seconds held, first bytes of the answer
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._keep_one_stalled, daemon=True) for _ in range(count)]

    def start(self) -> "StalledConnections":
        for thread in self.threads:
            thread.start()
        return self

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)

    def _keep_one_stalled(self) -> None:
        while not self.stop.is_set():
            try:
                sock = socket.create_connection(self.address, timeout=120)
            except OSError as exc:
                with self.lock:
                    self.closed.append({"error": f"connect: {exc}"})
                time.sleep(1)
                continue
            with sock:
                sent = time.perf_counter()
                sock.sendall(self.request)
                answer = b""
                try:
                    while chunk := sock.recv(65536):
                        answer += chunk
                except OSError as exc:
                    answer += f" ({type(exc).__name__})".encode()
                held = time.perf_counter() - sent
            with self.lock:
                self.closed.append({"held_s": round(held, 2), "status_line": answer.split(b"\r\n", 1)[0].decode("latin-1")[:60],
                                    "during_run": not self.stop.is_set()})


# ------------------------------------------------------------------------------ the other tenant
class PacedChats:
    """The other key's chats, one a second, timed (module docstring)."""

    def __init__(self, url: str, key: str, user: str, max_tokens: int) -> None:
        self.client = httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"})
        self.user, self.max_tokens = user, max_tokens
        self.statuses: Counter[int] = Counter()

    def run(self, seconds: float) -> list[float]:
        latencies: list[float] = []
        started = time.perf_counter()
        next_at = started
        while time.perf_counter() - started < seconds:
            time.sleep(max(0.0, next_at - time.perf_counter()))
            sent = time.perf_counter()
            next_at = max(next_at + 1.0, sent)  # after a slow answer, the next at once, never a burst to catch up
            answer = self.client.post("/v1/chat/completions", json=chat_body(self.user, self.max_tokens))
            self.statuses[answer.status_code] += 1
            if answer.status_code == 200:
                latencies.append(time.perf_counter() - sent)
        return latencies


class HealthProbe:
    """GET /health twice a second in a thread until stopped; its latencies and statuses."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seconds: list[float] = []
        self.statuses: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "HealthProbe":
        self.thread.start()
        return self

    def join(self) -> dict[str, Any]:
        self.stop.set()
        self.thread.join(30)
        return {"statuses": dict(self.statuses), **quantiles(self.seconds)}

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.wait(0.5):
                sent = time.perf_counter()
                try:
                    status = str(client.get("/health").status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                self.seconds.append(time.perf_counter() - sent)
                self.statuses[status] += 1
