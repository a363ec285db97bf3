"""The load the fault tests (tests/test_faults.py) run while they kill processes: concurrent adds
(each waiting for its fact's KV) and chats against the served app, every outcome recorded."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import requests

CLIENT_TIMEOUT_S = 90.0  # every request of the load; none may run into it


def post_json(url: str, path: str, body: dict, timeout: float = CLIENT_TIMEOUT_S) -> tuple[int, dict]:
    response = requests.post(url + path, json=body, timeout=timeout)
    return response.status_code, (response.json() if response.headers.get("content-type", "").startswith("application/json") else {})


def ask(url: str, user: str, question: str, timeout: float = CLIENT_TIMEOUT_S, top_k: int = 10) -> tuple[int, dict]:
    body = {"user": user, "messages": [{"role": "user", "content": question}], "max_tokens": 4, "memory": {"top_k": top_k}}
    return post_json(url, "/v1/chat/completions", body, timeout)


@dataclass
class Load:
    """Concurrent adds (one new fact each) and chats until stopped; records every outcome."""

    url: str
    users: list[str]
    acked: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    outcomes: list[tuple[str, object, float]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> "Load":
        for i in range(2):
            self.threads.append(threading.Thread(target=self._adds, args=(i,), daemon=True))
            self.threads.append(threading.Thread(target=self._chats, args=(i,), daemon=True))
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(CLIENT_TIMEOUT_S + 10)

    def _record(self, kind: str, call) -> object:
        started = time.monotonic()
        try:
            status, body = call()
        except requests.Timeout:
            status, body = "timeout", {}
        except requests.RequestException as exc:
            status, body = type(exc).__name__, {}
        self.outcomes.append((kind, status, time.monotonic() - started))
        if status != 200:
            time.sleep(0.5)
        return body if status == 200 else None

    def _adds(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n, user = n + 1, self.users[i % len(self.users)]
            text = f"{user} keeps item {n} of series {i} in box {7 * n + i}."
            add = {"user_id": user, "facts": [text], "wait_for_kv": True}  # each add waits for its KV: the load
            body = self._record("add", lambda: post_json(self.url, "/v1/memories", add))  # follows what the engine encodes
            if body is not None:
                self.acked[user].add(body["results"][0]["id"])

    def _chats(self, i: int) -> None:
        while not self.stop.is_set():
            user = ["seed", *self.users][i % (1 + len(self.users))]
            self._record("chat", lambda: ask(self.url, user, "Which box holds item 3?"))

    def check_no_request_hung(self) -> None:
        hung = [o for o in self.outcomes if o[1] == "timeout" or o[2] >= CLIENT_TIMEOUT_S]
        assert not hung, f"requests ran into the {CLIENT_TIMEOUT_S:.0f} s client timeout: {hung}"
        assert any(o[0] == "add" and o[1] == 200 for o in self.outcomes), self.outcomes
