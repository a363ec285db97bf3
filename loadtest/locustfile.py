"""Locust load test of the chat API: chat completions from a pool of users, plus /health.

Each chat request carries a `user` id drawn from a pool of KVMEM_LOADTEST_USERS ids (default
20), so the same users come back as they would to a memory service, and a question drawn from
a small built-in list. Each simulated client first gives its user a memory (KVMEM_LOADTEST_FACTS
facts, default 20, through POST /v1/memories; re-adding is idempotent), and chats with
memory mode KVMEM_LOADTEST_MEMORY_MODE (kv, prompt or none; default kv), so the same run can
be repeated per mode and compared. KVMEM_LOADTEST_TOP_K and KVMEM_LOADTEST_MAX_TOKENS set the
chats' memory.top_k and max_tokens, KVMEM_LOADTEST_API_KEY the key sent (auth.mode keys), and
KVMEM_LOADTEST_WAIT_S=0 makes each client a closed loop (QPS at a fixed concurrency).
KVMEM_LOADTEST_QUESTIONS=varied draws from 400 different questions instead of the 8 built-in ones
(with 8, a user soon repeats a question, and prompt injection is then served from vLLM's prefix
cache: it measures the cache, not the memory). Chat responses are streamed (server-sent events): besides
the POST row (time to the response headers), Locust reports the time to the first content
chunk ("TTFT chat") and to the end of the stream ("COMPLETE chat"), and the replica's own stage
timings from the stream's last chunk as "SERVER <stage>" (e.g. SERVER replica_ttft, engine_ttft,
prepare), with "SERVER outside_replica" = TTFT chat - replica_ttft: the time a chat spent in the
proxy, in Serve's queues and on the wire, so a slow TTFT under load is placed without another
tool. They are statistics of their own (loadtest/stage_stats.py: printed at the end and written to
PREFIX_stages.csv), so Locust's rows and its Aggregated row count requests only. A request counts as failed unless it answers 200 with a well-formed
stream ending in [DONE] and a non-empty assistant message.

    mkdir -p bench/results
    .venv/bin/locust -f loadtest/locustfile.py --headless -u 10 -r 2 -t 60s \\
        --host http://127.0.0.1:8000 --csv bench/results/locust

Importing this module imports locust, which monkey-patches the standard library with gevent.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any, Iterable

from locust import HttpUser, between, constant, task

try:
    from loadtest.stage_stats import record as record_stage
    from loadtest.users import memory_facts, user_pool, varied_questions
except ImportError:  # locust puts the locustfile's folder, not the project root, on sys.path
    from stage_stats import record as record_stage  # type: ignore[no-redef]
    from users import memory_facts, user_pool, varied_questions  # type: ignore[no-redef]

QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "My dog is called Biscuit. What would be a good trick to teach him?",
    "Explain what a hash table is in two sentences.",
    "I am vegetarian. Suggest a quick dinner.",
    "Write a haiku about autumn.",
    "How many minutes are there in a day?",
    "Remind me why the sky is blue.",
)
MAX_TOKENS = 64


ASKED: tuple[str, ...] = tuple(varied_questions()) if os.environ.get("KVMEM_LOADTEST_QUESTIONS") == "varied" else QUESTIONS


def chat_body(
    user: str, question: str, max_tokens: int = MAX_TOKENS, memory_mode: str = "kv", top_k: int | None = None
) -> dict[str, Any]:
    """Request body of POST /v1/chat/completions (serve_app.protocol.ChatCompletionRequest)."""
    memory: dict[str, Any] = {"mode": memory_mode}
    if top_k is not None:
        memory["top_k"] = top_k
    return {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "user": user,
        "memory": memory,
        "stream": True,
    }


def stream_problem(status_code: int, lines: Iterable[str], error: str = "") -> str | None:
    """Why a streamed chat completion counts as failed, or None when it is a good answer.
    `lines` are the response's text lines (server-sent events)."""
    if status_code != 200:
        return f"HTTP {status_code}: {' '.join(lines)[:200] or error}"
    content, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
            break
        try:
            content.append(json.loads(data)["choices"][0]["delta"].get("content") or "")
        except (ValueError, LookupError, TypeError, AttributeError) as exc:
            return f"malformed chunk ({exc!r}): {data[:200]}"
    if not done:
        return "stream ended without [DONE]"
    if not "".join(content).strip():
        return "empty completion"
    return None


def server_timings(lines: Iterable[str]) -> dict[str, float]:
    """The replica's stage timings in ms (the `timings` field of the stream's finishing chunk,
    serve_app.stage_timings), or {} when the stream carries none."""
    for line in reversed(list(lines)):
        if line.startswith("data: {") and '"timings"' in line:
            try:
                return {str(stage): float(ms) for stage, ms in json.loads(line[len("data: ") :])["timings"].items()}
            except (ValueError, LookupError, TypeError, AttributeError):
                return {}
    return {}


USERS = user_pool(int(os.environ.get("KVMEM_LOADTEST_USERS", "20")))
FACTS_PER_USER = int(os.environ.get("KVMEM_LOADTEST_FACTS", "20"))
MEMORY_MODE = os.environ.get("KVMEM_LOADTEST_MEMORY_MODE", "kv")
TOP_K = int(os.environ["KVMEM_LOADTEST_TOP_K"]) if os.environ.get("KVMEM_LOADTEST_TOP_K") else None  # None: the service's
CHAT_MAX_TOKENS = int(os.environ.get("KVMEM_LOADTEST_MAX_TOKENS", str(MAX_TOKENS)))
API_KEY = os.environ.get("KVMEM_LOADTEST_API_KEY")  # auth.mode keys: a key that may act for the pool's users
# KVMEM_LOADTEST_WAIT_S=0: each client sends its next chat as soon as the last one ends (a closed
# loop, for QPS at a given concurrency); unset: a think time of 0.5-2 s, like a person chatting
WAIT_S = os.environ.get("KVMEM_LOADTEST_WAIT_S")


class ChatUser(HttpUser):
    """A client that mostly chats and now and then checks /health."""

    wait_time = constant(float(WAIT_S)) if WAIT_S else between(0.5, 2.0)

    def on_start(self) -> None:
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"
        self.user_id = random.choice(USERS)
        # Serve's session header: with `routing: direct` the proxy sends the request straight to the
        # replica of the user's shard (serve_app.ingress.shard_router); the ChatAPI router ignores it
        self.client.headers["x-session-id"] = self.user_id
        if FACTS_PER_USER > 0:
            body = {"user_id": self.user_id, "facts": memory_facts(self.user_id, FACTS_PER_USER)}
            self.client.post("/v1/memories", json=body, name="memories/add")

    @task(10)
    def chat(self) -> None:
        body = chat_body(self.user_id, random.choice(ASKED), max_tokens=CHAT_MAX_TOKENS, memory_mode=MEMORY_MODE, top_k=TOP_K)
        started = time.perf_counter()
        with self.client.post("/v1/chat/completions", json=body, name="chat", stream=True, catch_response=True) as response:
            lines: list[str] = []
            first_content_at = None
            if response.status_code == 200:
                for line in response.iter_lines(decode_unicode=True):
                    lines.append(line)
                    if first_content_at is None and '"content"' in line:
                        first_content_at = time.perf_counter()
            # On a connection error the status is 0, the text empty and the cause in `error`.
            problem = stream_problem(response.status_code, lines or [response.text or ""], str(getattr(response, "error", "") or ""))
            if problem:
                response.failure(problem)
                return
            response.success()
        finished = time.perf_counter()
        rows = [("TTFT", "chat", first_content_at), ("COMPLETE", "chat", finished)]
        rows = [(kind, name, (at - started) * 1000) for kind, name, at in rows if at is not None]
        timings = server_timings(lines)
        rows += [("SERVER", stage, ms) for stage, ms in timings.items()]
        if first_content_at is not None and "replica_ttft" in timings:
            rows.append(("SERVER", "outside_replica", (first_content_at - started) * 1000 - timings["replica_ttft"]))
        for kind, name, ms in rows:  # apart from Locust's request rows (loadtest/stage_stats.py)
            record_stage(kind, name, ms)

    @task(1)
    def health(self) -> None:
        self.client.get("/health", name="health")
