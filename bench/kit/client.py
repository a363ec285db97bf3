"""The service's HTTP API as the benches call it: one streamed chat timed (to the first event, to
the first content, the ingress's Server-Timing split), a user's memory seeded, the shards settled."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx


def stream_once(client: httpx.Client, path: str, body: dict[str, Any], raise_on_error: bool = False) -> dict[str, Any]:
    """One streamed chat: ms to the first event and to the first content, the answer, the memory
    report, the stages of the last chunk and the Server-Timing header; an error chunk raises with
    `raise_on_error`."""
    sent_at, started = time.time(), time.perf_counter()
    first = first_content = None
    last: dict[str, Any] = {}
    parts: list[str] = []
    memory: dict[str, Any] | None = None
    session = {"x-session-id": body["user"]} if body.get("user") else None  # routing: direct goes straight to the shard
    with client.stream("POST", path, json={**body, "stream": True}, headers=session) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {response.status_code}: {response.read().decode()[:300]}")
        timing = response.headers.get("server-timing", "")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            first = first if first is not None else now
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if raise_on_error and "error" in chunk:
                raise RuntimeError(f"chat stream error: {chunk['error']}")
            content = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or [])
            if content:
                first_content = now if first_content is None else first_content
                parts.append(content)
            memory = chunk.get("memory") or memory
            last = chunk
    ingress = {name: float(ms) for name, ms in (p.split(";dur=") for p in timing.split(", ") if ";dur=" in p)}
    handler_at = [float(p.split('"')[1]) for p in timing.split(", ") if p.startswith('started;desc="')]
    if handler_at and "ingress" in ingress and first is not None:  # same host: one wall clock
        # the client's time to the first event outside the ingress's handler: before it starts, after it returns
        ingress["http_before_handler"] = (handler_at[0] - sent_at) * 1e3
        ingress["http_after_handler"] = (first - started) * 1e3 - ingress["http_before_handler"] - ingress["ingress"]
    return {
        "http_ms": (first - started) * 1e3 if first is not None else None,
        "content_ms": (first_content - started) * 1e3 if first_content is not None else None,
        "stages": {**(last.get("timings") or {}), **{f"ingress_{k}": v for k, v in ingress.items()}},
        "cached_tokens": (last.get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens"),
        "prompt_tokens": (last.get("usage") or {}).get("prompt_tokens"),
        "injected_tokens": (last.get("memory") or {}).get("injected_tokens"),
        "content": "".join(parts),
        "memory": memory,
    }


def seed_user(client: httpx.Client, user: str, facts: list[str]) -> int:
    """Adds `facts` to `user`'s memory, 64 an add, each waiting for its KV; how many were stored."""
    added = 0
    for i in range(0, len(facts), 64):
        response = client.post("/v1/memories", json={"user_id": user, "facts": facts[i:i + 64], "wait_for_kv": True})
        response.raise_for_status()
        added += len(response.json()["results"])
    return added


def settled_shards(client: httpx.Client, within_s: float) -> tuple[list[dict[str, Any]] | None, float]:
    """Every shard's stats (GET /v1/shards: `client` carries an admin key) once none has an encode
    pending and each answered fresh (not a busy replica's last stats), and the seconds that took;
    None when not within `within_s`."""
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        try:
            stats = client.get("/v1/shards", timeout=10).json()["results"]
            if all(s.get("pending_encodes") == 0 and "stale_s" not in s and "unavailable" not in s for s in stats):
                return stats, round(time.monotonic() - started, 1)
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(1)
    return None, round(time.monotonic() - started, 1)
