"""Locust load test of the chat API: chat completions from a pool of users, plus /health.

Each chat request carries a `user` id drawn from a pool of KVMEM_LOADTEST_USERS ids (default
20), so the same users come back as they would to a memory service, and a question drawn from
a small built-in list. Responses are not streamed, so Locust's response time is the whole
completion time (no time to first token). A request counts as failed unless it answers 200
with a non-empty assistant message.

    mkdir -p bench/results
    .venv/bin/locust -f loadtest/locustfile.py --headless -u 10 -r 2 -t 60s \\
        --host http://127.0.0.1:8000 --csv bench/results/locust

Importing this module imports locust, which monkey-patches the standard library with gevent.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

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


def chat_body(user: str, question: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """Request body of POST /v1/chat/completions (serve_app.protocol.ChatCompletionRequest)."""
    return {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "user": user,
    }


def completion_problem(status_code: int, text: str) -> str | None:
    """Why a chat-completions response counts as failed, or None when it is a good answer."""
    if status_code != 200:
        return f"HTTP {status_code}: {text[:200]}"
    try:
        content = json.loads(text)["choices"][0]["message"]["content"]
    except (ValueError, LookupError, TypeError) as exc:
        return f"malformed completion ({exc!r}): {text[:200]}"
    if not isinstance(content, str) or not content.strip():
        return "empty completion"
    return None


USERS = user_pool(int(os.environ.get("KVMEM_LOADTEST_USERS", "20")))


class ChatUser(HttpUser):
    """A client that mostly chats and now and then checks /health."""

    wait_time = between(0.5, 2.0)

    @task(10)
    def chat(self) -> None:
        body = chat_body(random.choice(USERS), random.choice(QUESTIONS))
        with self.client.post("/v1/chat/completions", json=body, name="chat", catch_response=True) as response:
            # On a connection error the status is 0, the text empty and the cause in `error`.
            text = response.text or str(getattr(response, "error", "") or "")
            problem = completion_problem(response.status_code, text)
            if problem:
                response.failure(problem)
            else:
                response.success()

    @task(1)
    def health(self) -> None:
        self.client.get("/health", name="health")
