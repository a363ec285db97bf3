"""Locust load test of the chat API: chat completions from a pool of users, plus /health.

Each chat request carries a `user` id drawn from a pool of KVMEM_LOADTEST_USERS ids (default
20), so the same users come back as they would to a memory service, and a question drawn from
a small built-in list. Each simulated client first gives its user a memory (KVMEM_LOADTEST_FACTS
facts, default 20, through POST /v1/memories; re-adding is idempotent), and chats with
memory mode KVMEM_LOADTEST_MEMORY_MODE (kv, prompt or none; default kv), so the same run can
be repeated per mode and compared. Responses are not streamed, so Locust's response time is the whole
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
