"""The HTTP path's own latency, for bench/serve/serve_h200.py (parts `floor` and `first_chunk`).

- floor: ms to the first streamed event through bench/serve/serve_floor.py's no-op applications, from
  Ray Serve's own floor up to the service's real routes over a no-op replica (`serve_floor_ms`,
  `serve_floor_ladder_ms`, and floor_routes' stages split before and after its handler).
- first_chunk: the service's own chats with a one-token and a 16-token answer, to see whether the
  rest of a request delays its first chunk (`first_chunk_ms`).
"""

from __future__ import annotations

from typing import Any

import httpx

from bench.serve.serve_parts import TTFT_USER, Context, Part, median, seed_user, stream_once

FLOOR_PATHS = {  # bench/serve/serve_floor.py's applications, from Serve's own floor up to the service's routes
    "chain": "/floor", "direct": "/floor-direct", "direct_routed": "/floor-direct-routed", "routes": "/floor-routes",
}


def first_chunk(ctx: Context) -> dict[str, Any]:
    """Does the rest of a request delay its first chunk? The same chats (k = 50, none and kv) with
    a one-token answer, where the request's finishing work runs right behind the first event, and
    with a 16-token answer, where the engine's next step follows instead (rounds interleaved)."""
    from bench.quality.locomo_qa import load_conversations

    (conversation,) = load_conversations(ctx.locomo, [0], "first_chunk", None, None)
    questions = [q["question"] for q in conversation.questions]
    cells = [(mode, tokens) for mode in ("none", "kv") for tokens in (1, 16)]
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {cell: [] for cell in cells}
    with ctx.client() as client:
        if not client.get("/v1/memories", params={"user_id": TTFT_USER}).json().get("results"):
            facts = [f for turn in conversation.turns for f in conversation.facts_by_turn.get(turn.turn_id, [])]
            seed_user(client, TTFT_USER, facts)
        for round_index in range(ctx.rounds + 3):
            for mode, tokens in cells:
                body = {"user": TTFT_USER, "messages": [{"role": "user", "content": questions[round_index % len(questions)]}],
                        "max_tokens": tokens, "memory": {"mode": mode, "top_k": 50}}
                sample = stream_once(client, "/v1/chat/completions", body)
                if round_index >= 3:
                    samples[(mode, tokens)].append(sample)
    out: dict[str, Any] = {}
    for (mode, tokens), rows in samples.items():
        stages = {name: median([r["stages"][name] for r in rows if name in r["stages"]])
                  for name in ("engine_ttft", "ingress_ingress", "ingress_http_before_handler", "ingress_http_after_handler")}
        out.setdefault(mode, {})[str(tokens)] = {"http_ms": median([r["http_ms"] for r in rows]), **stages}
    return {"first_chunk_ms": out}


def floor(ctx: Context) -> dict[str, Any]:
    """Ms to the first streamed event through each no-op application (median; rounds interleaved),
    with the body and headers of a chat with memory (a user, its x-session-id)."""
    body = {"user": "bench-floor", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    times: dict[str, list[float]] = {name: [] for name in FLOOR_PATHS}
    split: dict[str, list[float]] = {}
    with ctx.client() as client:
        for round_index in range(ctx.rounds + 10):
            for name, prefix in FLOOR_PATHS.items():
                try:
                    sample = stream_once(client, f"{prefix}/v1/chat/completions", body)
                except (RuntimeError, httpx.HTTPError):
                    continue  # an application missing from this deployment (an older tree)
                if round_index >= 10:
                    times[name].append(sample["http_ms"])
                    for stage, ms in sample["stages"].items():  # floor_routes runs the service's routes: its stages
                        split.setdefault(stage, []).append(ms)
    out: dict[str, Any] = {"serve_floor_ladder_ms": {name: median(values) for name, values in times.items()},
                           "serve_floor_routes_stages_ms": {stage: median(values) for stage, values in split.items()}}
    out["serve_floor_chain_ms"], out["serve_floor_direct_ms"] = out["serve_floor_ladder_ms"]["chain"], out["serve_floor_ladder_ms"]["direct"]
    # the floor with the service's own hop structure: proxy -> replica for routing: direct
    out["serve_floor_ms"] = out["serve_floor_direct_ms" if ctx.routing == "direct" else "serve_floor_chain_ms"]
    return out


PARTS = {
    "floor": Part(floor, 15),
    "first_chunk": Part(first_chunk, 30),
}
