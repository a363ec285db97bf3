"""Locust load test of the chat API: chat completions from a pool of users, plus /health.

Each chat request carries a `user` id drawn from a pool of KVMEM_LOADTEST_USERS ids (default
20), so the same users come back as they would to a memory service, and a question drawn from
a small built-in list. Each simulated client first gives its user a memory (KVMEM_LOADTEST_FACTS
facts, default 20, through POST /v1/memories; re-adding is idempotent), and chats with
memory mode KVMEM_LOADTEST_MEMORY_MODE (kv, prompt or none; default kv), so the same run can
be repeated per mode and compared. Chat responses are streamed (server-sent events): besides
the POST row (time to the response headers), Locust reports the time to the first content
chunk ("TTFT chat") and to the end of the stream ("COMPLETE chat") as rows of their own. A request counts as failed unless it answers 200 with a well-formed
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

from locust import HttpUser, between, task

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


def user_pool(size: int) -> list[str]:
    """The user ids requests are drawn from."""
    if size < 1:
        raise ValueError(f"the user pool needs at least one user, got {size}")
    return [f"loadtest-user-{index:04d}" for index in range(size)]


FACT_TEMPLATES: tuple[str, ...] = (
    "{user} has a dog called Biscuit.",
    "{user} is vegetarian.",
    "{user} lives in a flat in Leeds.",
    "{user} works night shifts as a nurse.",
    "{user} is learning to play the cello.",
    "{user} is allergic to peanuts.",
    "{user} runs 5 km every Sunday.",
    "{user} is saving for a trip to Japan.",
)


def memory_facts(user: str, count: int) -> list[str]:
    """The facts a load-test user's memory is seeded with (numbered beyond the templates)."""
    return [FACT_TEMPLATES[i % len(FACT_TEMPLATES)].format(user=user) + (f" (note {i})" if i >= len(FACT_TEMPLATES) else "") for i in range(count)]


def chat_body(user: str, question: str, max_tokens: int = MAX_TOKENS, memory_mode: str = "kv") -> dict[str, Any]:
    """Request body of POST /v1/chat/completions (serve_app.protocol.ChatCompletionRequest)."""
    return {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "user": user,
        "memory": {"mode": memory_mode},
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


USERS = user_pool(int(os.environ.get("KVMEM_LOADTEST_USERS", "20")))
FACTS_PER_USER = int(os.environ.get("KVMEM_LOADTEST_FACTS", "20"))
MEMORY_MODE = os.environ.get("KVMEM_LOADTEST_MEMORY_MODE", "kv")


class ChatUser(HttpUser):
    """A client that mostly chats and now and then checks /health."""

    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        self.user_id = random.choice(USERS)
        if FACTS_PER_USER > 0:
            body = {"user_id": self.user_id, "facts": memory_facts(self.user_id, FACTS_PER_USER)}
            self.client.post("/v1/memories", json=body, name="memories/add")

    @task(10)
    def chat(self) -> None:
        body = chat_body(self.user_id, random.choice(QUESTIONS), memory_mode=MEMORY_MODE)
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
        for kind, at in (("TTFT", first_content_at), ("COMPLETE", finished)):
            if at is not None:
                self.environment.events.request.fire(
                    request_type=kind, name="chat", response_time=(at - started) * 1000, response_length=0, exception=None, context={}
                )

    @task(1)
    def health(self) -> None:
        self.client.get("/health", name="health")
