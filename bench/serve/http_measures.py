"""What bench/serve/serve_http.py measures against a running service, one function each; each takes
the Context and returns keys of the result. The measures: docs/bench.md."""

from __future__ import annotations

import csv
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.kit.client import seed_user, stream_once
from bench.kit.results import median

MODES = ("none", "prompt", "kv")
KS = (5, 10, 20, 50)
LOCUST_USERS = (10, 25, 50, 100)
LOCUST_POOL = 40  # memory users the Locust clients draw from
TTFT_USER = "bench-ttft"


@dataclass
class Context:
    url: str
    admin_key: str
    out: Path
    locomo: Path
    deadline: float
    rounds: int = 30
    locust_users: tuple[int, ...] = LOCUST_USERS
    locust_seconds: int = 15
    locust_questions: tuple[str, ...] = ("fixed",)  # loadtest's question sets: fixed (8), varied (400)
    routing: str = "router"  # the service's topology: which floor has its hop structure
    modes: tuple[str, ...] = MODES  # the ttft part's cells: modes x ks
    ks: tuple[int, ...] = KS

    def client(self, timeout_s: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=timeout_s)


def examples(ctx: Context) -> dict[str, Any]:
    """The README's curl examples, as a user types them (statuses and what came back)."""
    seen: dict[str, Any] = {}
    with ctx.client() as client:
        calls = [
            ("chat", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32}),
            ("health", "GET", "/health", None),
            ("add_facts", "POST", "/v1/memories", {"user_id": "erin", "facts": ["Erin has a cat called Miso.", "Erin works as a nurse in Leeds."], "wait_for_kv": True}),
            ("add_messages", "POST", "/v1/memories", {"user_id": "erin", "messages": [{"role": "user", "content": "I just moved to Berlin."}]}),
            ("chat_memory", "POST", "/v1/chat/completions", {"user": "erin", "messages": [{"role": "user", "content": "What is my cat called?"}], "max_tokens": 32}),
            ("shards", "GET", "/v1/shards", None),
        ]
        for name, method, path, body in calls:
            user = (body or {}).get("user") or (body or {}).get("user_id")
            response = client.request(method, path, json=body, headers={"x-session-id": user} if user else None)
            payload = response.json() if response.headers.get("content-type", "").startswith("application/json") else response.text[:200]
            seen[name] = {"status": response.status_code, "memory": payload.get("memory") if isinstance(payload, dict) else None}
        shards = payload["results"] if isinstance(payload, dict) else []
    return {"examples": seen, "index_backend": [s.get("index_backend") for s in shards], "shards": shards}


def ttft(ctx: Context) -> dict[str, Any]:
    from bench.quality.locomo_qa import load_conversations

    (conversation,) = load_conversations(ctx.locomo, [0], "ttft", None, None)
    facts = [fact for turn in conversation.turns for fact in conversation.facts_by_turn.get(turn.turn_id, [])]
    questions = [q["question"] for q in conversation.questions]
    rng = random.Random(0)
    cells = [(mode, k) for mode in ctx.modes for k in ctx.ks]
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {cell: [] for cell in cells}
    with ctx.client() as client:
        seeded = seed_user(client, TTFT_USER, facts)
        for round_index in range(ctx.rounds + 3):  # 3 warm-up rounds
            question = questions[round_index % len(questions)]
            rng.shuffle(cells)
            for mode, k in cells:
                body = {"user": TTFT_USER, "messages": [{"role": "user", "content": question}], "max_tokens": 1,
                        "memory": {"mode": mode, "top_k": k}}
                sample = stream_once(client, "/v1/chat/completions", body)
                if round_index >= 3:
                    samples[(mode, k)].append(sample)
    out: dict[str, Any] = {"ttft_user_facts": seeded, "ttft_rounds": ctx.rounds, "http_ttft_ms": {}, "engine_ttft_ms": {},
                           "http_content_ms": {}, "stages_ms": {}, "cached_tokens": {}}
    for (mode, k), rows in sorted(samples.items()):
        out["http_ttft_ms"].setdefault(mode, {})[str(k)] = median([r["http_ms"] for r in rows])
        out["http_content_ms"].setdefault(mode, {})[str(k)] = median([r["content_ms"] for r in rows if r["content_ms"] is not None])
        out["engine_ttft_ms"].setdefault(mode, {})[str(k)] = median([r["stages"].get("engine_ttft") for r in rows if "engine_ttft" in r["stages"]])
        stages = sorted({s for r in rows for s in r["stages"]})
        out["stages_ms"].setdefault(mode, {})[str(k)] = {s: median([r["stages"][s] for r in rows if s in r["stages"]]) for s in stages}
        out["cached_tokens"].setdefault(mode, {})[str(k)] = median([r["cached_tokens"] or 0 for r in rows])
    return out


def ingest(ctx: Context) -> dict[str, Any]:
    """LoCoMo conversation 0 added turn by turn through HTTP, as a chat app adds memory (one add a
    turn, not waiting for KV): per-add latency and when every fact's KV is live after the last add."""
    from bench.quality.locomo_qa import Service, ingest, load_conversations, wait_for_encodes

    service = Service(ctx.url, ctx.admin_key, timeout_s=300.0, connections=4)
    (conversation,) = load_conversations(ctx.locomo, [0], f"ingest-{uuid.uuid4().hex[:6]}", None, 0)
    try:
        added = ingest(service, [conversation], extract=False)
        encoded = wait_for_encodes(service, 300.0, 0.05)
    finally:
        service.call("DELETE", "/v1/memories", params={"user_id": conversation.user_id})
    latency, with_facts = added["add_latency_ms"], added["add_with_facts_latency_ms"]
    return {"ingest": {
        "wait_for_kv": False, "turns": len(conversation.turns), "adds": added["adds"], "facts": added["facts"],
        "seconds": added["seconds"], "per_add_p50_ms": latency["p50"], "per_add_p90_ms": latency["p90"],
        "per_add_p99_ms": latency["p99"], "adds_with_facts": added["adds_with_facts"],
        "per_fact_add_p50_ms": with_facts["p50"], "per_fact_add_p90_ms": with_facts["p90"],
        "kv_live_after_last_add_s": encoded["encode_wait_s"], **{k: v for k, v in encoded.items() if k.startswith("shard_")}}}


def locust_command(ctx: Context, mode: str, users: int, seconds: int, prefix: Path, questions: str = "fixed", *,
                   pool: int = LOCUST_POOL, top_k: int = 50, max_tokens: int = 50, wait_s: float = 0.0,
                   processes: int = 4) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one headless Locust run over the seeded pool (closed
    loop when wait_s is 0); bench/serve/crash_recovery.py runs it in the background."""
    env = dict(os.environ, KVMEM_LOADTEST_USERS=str(pool), KVMEM_LOADTEST_FACTS="0", KVMEM_LOADTEST_MEMORY_MODE=mode,
               KVMEM_LOADTEST_TOP_K=str(top_k), KVMEM_LOADTEST_MAX_TOKENS=str(max_tokens), KVMEM_LOADTEST_WAIT_S=f"{wait_s:g}",
               KVMEM_LOADTEST_API_KEY=ctx.admin_key, KVMEM_LOADTEST_QUESTIONS=questions)
    command = [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", str(users), "-r", str(users),
               "-t", f"{seconds}s", "--host", ctx.url, "--csv", str(prefix), "--only-summary"]
    return command + (["--processes", str(processes)] if processes > 1 else []), env


def run_locust(ctx: Context, mode: str, users: int, seconds: int, prefix: Path, questions: str = "fixed") -> dict[str, Any]:
    """One closed-loop Locust run (k = 50, 50 output tokens) over the seeded pool, asking the
    locustfile's 8 built-in questions (`fixed`) or 400 different ones (`varied`): its CSV rows
    for the chats (`chat`), their first content (`first`) and the replica's stages (`server`: stage -> row)."""
    command, env = locust_command(ctx, mode, users, seconds, prefix, questions)
    subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=seconds + 60)
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(f"{prefix}_stats.csv"))}
    stages = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(f"{prefix}_stages.csv"))}  # loadtest/stage_stats.py
    server = {name: row for (kind, name), row in stages.items() if kind == "SERVER"}
    return {"chat": rows.get(("POST", "chat"), {}), "first": stages.get(("TTFT", "chat"), {}), "server": server}


def seed_locust_pool(ctx: Context) -> None:
    """The Locust users' memories: 40 users x 55 facts (the arena holds them all, 2 pages a fact)."""
    from loadtest.users import memory_facts, user_pool

    with ctx.client() as client:
        for user in user_pool(LOCUST_POOL):
            seed_user(client, user, memory_facts(user, 55))


def locust(ctx: Context) -> dict[str, Any]:
    """Closed-loop Locust runs per question set, number of users and mode; users are seeded first
    so the runs measure chats only. `locust_qps` asks the 8 built-in questions (repeated, so
    prompt injection often hits vLLM's prefix cache), `locust_qps_varied` 400 different ones."""
    seed_locust_pool(ctx)
    out: dict[str, Any] = {"locust_seconds": ctx.locust_seconds}
    seconds = ctx.locust_seconds
    csv_dir = Path(tempfile.mkdtemp(prefix="kvmem-locust-"))  # Locust's CSVs stay here: only the JSON travels back
    for questions in ctx.locust_questions:
        suffix = "" if questions == "fixed" else f"_{questions}"
        qps: dict[str, dict[str, float]] = out.setdefault(f"locust_qps{suffix}", {})
        latency: dict[str, dict[str, dict[str, float]]] = out.setdefault(f"locust_ttft_ms{suffix}", {})
        # mode -> users -> stage -> [p50, p99] ms: the replica's stages under load, and outside_replica
        server: dict[str, dict[str, dict[str, list[float]]]] = out.setdefault(f"locust_server_ms{suffix}", {})
        for users in ctx.locust_users:
            for mode in ("kv", "prompt", "none"):
                if time.monotonic() + seconds + 15 > ctx.deadline:
                    break
                rows = run_locust(ctx, mode, users, seconds, csv_dir / f"locust_{questions}_{mode}_{users}", questions)
                chat, first = rows["chat"], rows["first"]
                qps.setdefault(mode, {})[str(users)] = round(float(chat.get("Requests/s", 0) or 0), 2)
                latency.setdefault(mode, {})[str(users)] = {"ttft_p50_ms": float(first.get("50%", 0) or 0),
                                                            "ttft_p99_ms": float(first.get("99%", 0) or 0),
                                                            "failures": int(chat.get("Failure Count", 0) or 0)}
                server.setdefault(mode, {})[str(users)] = {
                    stage: [float(row.get("50%", 0) or 0), float(row.get("99%", 0) or 0)] for stage, row in rows["server"].items()
                }
    return out


def diagnose(ctx: Context) -> dict[str, Any]:
    """/health now; when a shard is not answering, the Ray states of the shard actors' unfinished
    tasks (where calls wait: ordering, arguments, or running), to find why."""
    with ctx.client(timeout_s=30) as client:
        health = client.get("/health").json()
    out: dict[str, Any] = {"health_after": health}
    if health.get("status") != "ok":
        script = (
            "import json, ray\n"
            "from ray.util.state import list_actors, list_tasks\n"
            "ray.init(address='auto', logging_level='ERROR')\n"
            "shards = [a.actor_id for a in list_actors(filters=[('class_name', '=', 'ShardActor')])]\n"
            "tasks = [t for t in list_tasks(filters=[('state', '!=', 'FINISHED')], limit=2000) if t.actor_id in shards]\n"
            "from collections import Counter\n"
            "print(json.dumps({'by_state': {f'{n} {s}': c for (n, s), c in Counter((t.name, t.state) for t in tasks).items()},\n"
            "                  'not_waiting': [(t.name, t.state) for t in tasks if 'ORDERING' not in t.state][:50]}))\n"
        )
        env = dict(os.environ, RAY_AUTH_MODE="token")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
        out["shard_tasks_unfinished"] = done.stdout[-20000:] or done.stderr[-3000:]
        started = time.monotonic()  # the shard watchdog restarts a silent shard: how long until ok
        while time.monotonic() < ctx.deadline - 5:
            time.sleep(5)
            with ctx.client(timeout_s=30) as client:
                if client.get("/health").json().get("status") == "ok":
                    out["health_ok_again_after_s"] = round(time.monotonic() - started, 1)
                    break
    return out


FLOOR_PATHS = {  # bench/serve/serve_floor.py's applications, from Serve's own floor up to the service's routes
    "chain": "/floor", "direct": "/floor-direct", "direct_routed": "/floor-direct-routed", "routes": "/floor-routes",
}


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
