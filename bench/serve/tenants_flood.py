"""One tenant's flood against another tenant's chats, on the CPU service: fairness (issue 25). What
is measured and usage: docs/bench.md."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.kit.client import settled_shards
from bench.kit.results import REPO, RESULTS, write_result
from bench.kit.results import median as p50
from bench.kit.service import config_args, serve_in_process
from devtools.local_redis import LocalRedis
from devtools.offline_models import prepare_smollm2

ADMIN_KEY = f"kvm-bench-admin-{uuid.uuid4().hex}"
UNFAIR = {"max_pending_encodes_per_user": 0, "arena_floor_entries_per_user": 0, "encode_share_while_chatting": 1.0,
          "encode_batch_while_chatting": 32}  # everything memory.fairness and the encoder's yielding do, off
QUESTION = "What does Bea keep in the blue tin?"


def service_args(redis_url: str, arena_dir: str, arena_pages: int | None, unfair: bool) -> dict[str, Any]:
    """config.yaml's application args, with the bench's Redis, arena, keys and fairness settings;
    admission off (the fairness runs measure the shard alone)."""
    args = config_args()
    namespace = f"tenants{uuid.uuid4().hex[:6]}"
    args.update(redis_url=redis_url, namespace=namespace, llm_replica_num_cpus=0,
                auth={"mode": "keys", "admin_key": ADMIN_KEY})
    args["admission"] = {"enabled": False}
    args["engine"]["model"] = str(prepare_smollm2())
    memory = args.setdefault("memory", {})
    memory.update(arena_dir=arena_dir, redis_prefix=f"kvmem-{namespace}")
    if arena_pages is not None:
        memory.setdefault("arena", {})["num_pages"] = arena_pages
    if unfair:
        memory.update(UNFAIR)
    return args


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat_once(client: httpx.Client, key: str, user: str, max_tokens: int) -> float:
    body = {"messages": [{"role": "user", "content": QUESTION}], "user": user, "max_tokens": max_tokens,
            "memory": {"mode": "kv"}}
    started = time.perf_counter()
    response = client.post("/v1/chat/completions", json=body, headers=bearer(key))
    response.raise_for_status()
    return time.perf_counter() - started


class Flood:
    """A's clients adding fact batches until `stop` is set; what each add got back."""

    def __init__(self, client: httpx.Client, key: str, user: str, clients: int, batch: int, max_backoff_s: float) -> None:
        self.client, self.key, self.user, self.batch, self.max_backoff_s = client, key, user, batch, max_backoff_s
        self.statuses: Counter[str] = Counter()
        self.acked: list[str] = []
        self.facts_sent = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> "Flood":
        for thread in self.threads:
            thread.start()
        return self

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def _run(self, client_no: int) -> None:
        n = 0
        while not self.stop.is_set():
            facts = [f"Ann's note {client_no}-{n}-{i}: shelf {i} holds {n} red boxes of screws." for i in range(self.batch)]
            n += 1
            try:
                response = self.client.post("/v1/memories", json={"user_id": self.user, "facts": facts}, headers=bearer(self.key))
            except httpx.HTTPError as exc:
                with self.lock:
                    self.statuses[type(exc).__name__] += 1
                continue
            with self.lock:
                self.statuses[str(response.status_code)] += 1
                if response.status_code == 200:
                    self.acked += [r["id"] for r in response.json()["results"]]
                    self.facts_sent += len(facts)
            if response.status_code == 429:
                self.stop.wait(min(self.max_backoff_s, float(response.headers.get("Retry-After", "1"))))


@contextmanager
def running_service(args: argparse.Namespace) -> Iterator[tuple[httpx.Client, dict[str, str], dict[str, Any]]]:
    """The service (module docstring), an HTTP client on it, the two users' keys and the settings."""
    workdir = Path(tempfile.mkdtemp(prefix="kvmem-tenants-"))
    arena_dir = tempfile.mkdtemp(prefix="kvmem-tenants-", dir="/dev/shm")
    redis = LocalRedis(workdir / "redis").start()
    settings = service_args(redis.url, arena_dir, args.arena_pages, args.unfair)
    http_options = yaml.safe_load((REPO / "config.yaml").read_text())["http_options"]
    try:
        print("starting the service (config.yaml, auth.mode keys) ...", flush=True)
        with serve_in_process(settings, http_options=http_options) as url:
            client = httpx.Client(base_url=url, timeout=args.timeout_s, headers=bearer(ADMIN_KEY))  # a tenant's call: its key
            keys = {}
            for user in ("ann", "bea"):
                made = client.post("/v1/admin/keys", json={"users": [user], "label": f"tenants bench {user}"})
                made.raise_for_status()
                keys[user] = made.json()["key"]
            yield client, keys, settings
    finally:
        redis.stop()
        shutil.rmtree(arena_dir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with running_service(args) as (client, keys, settings):
        b_facts = [f"Bea keeps fact {i} in the blue tin: {i} silver coins from Porto." for i in range(args.b_facts)]
        added = client.post("/v1/memories", json={"user_id": "bea", "facts": b_facts, "wait_for_kv": True}, headers=bearer(keys["bea"]))
        added.raise_for_status()
        b_ids = [r["id"] for r in added.json()["results"]]
        chat_once(client, keys["bea"], "bea", args.max_tokens)  # warm-up, not counted
        load = {"before_alone": os.getloadavg()[0]}  # the machine is shared: its load says how comparable two phases are
        alone = [chat_once(client, keys["bea"], "bea", args.max_tokens) for _ in range(args.alone_chats)]
        print(f"B alone: {len(alone)} chats, p50 {p50(alone):.2f} s", flush=True)

        load["before_flood"] = os.getloadavg()[0]
        flood = Flood(client, keys["ann"], "ann", args.clients, args.batch_facts, args.max_backoff_s).start()
        during: list[float] = []
        flood_started = time.perf_counter()
        next_report = 5.0
        while (elapsed := time.perf_counter() - flood_started) < args.flood_s:
            during.append(chat_once(client, keys["bea"], "bea", args.max_tokens))
            if elapsed >= next_report:
                next_report += 5.0
                print(f"  {elapsed:5.1f} s: B chats {len(during)} (last {during[-1]:.2f} s), A adds {dict(flood.statuses)}", flush=True)
        flood.join()
        load["after_flood"] = os.getloadavg()[0]
        print(f"B during the flood: {len(during)} chats, p50 {p50(during):.2f} s", flush=True)

        listed = client.get("/v1/memories", params={"user_id": "ann"}, headers=bearer(keys["ann"]))
        listed.raise_for_status()
        listed_ids = {r["id"] for r in listed.json()["results"]}
        bea_records = client.get("/v1/memories", params={"user_id": "bea"}, headers=bearer(keys["bea"])).json()["results"]
        b_kv = Counter(r["kv"] for r in bea_records if r["id"] in set(b_ids))
        shards = client.get("/v1/shards").json()
        # B alone again once A's backlog is encoded: the machine is shared, so alone is measured on
        # both sides of the flood (a load that changed meanwhile shows as before != after)
        settled, waited_s = settled_shards(client, args.drain_wait_s)
        drained_s = waited_s if settled is not None else None
        alone_after = [chat_once(client, keys["bea"], "bea", args.max_tokens) for _ in range(args.alone_chats)] if drained_s is not None else []
        load["after_alone"] = os.getloadavg()[0]
        if alone_after:
            print(f"B alone after the backlog drained ({drained_s:.0f} s): p50 {p50(alone_after):.2f} s", flush=True)
        alone_all = alone + alone_after
        result = {
            "alone_p50_s": p50(alone_all),
            "alone_before_p50_s": p50(alone),
            "alone_after_p50_s": p50(alone_after) if alone_after else None,
            "backlog_drained_s": None if drained_s is None else round(drained_s, 1),
            "during_flood_p50_s": p50(during),
            "ratio": round(p50(during) / p50(alone_all), 2),
            "flood_statuses": dict(flood.statuses),
            "b_facts_evicted": sum(n for kv, n in b_kv.items() if kv != "live"),
            "b_facts_kv": dict(b_kv),
            "lost_facts": len(set(flood.acked) - listed_ids),
            "a_facts_acknowledged": len(flood.acked),
            "chats_alone": len(alone),
            "chats_during_flood": len(during),
            "load_average_1m": load,
            "alone_s": [round(v, 3) for v in alone],
            "alone_after_s": [round(v, 3) for v in alone_after],
            "during_flood_s": [round(v, 3) for v in during],
            "shard_after": {k: shards["results"][0].get(k) for k in ("pending_encodes", "facts", "facts_with_kv", "kv_evictions_total")},
            "settings": {
                "fairness": "off" if args.unfair else "on",
                "memory": {k: settings["memory"].get(k, "default") for k in (*UNFAIR, "arena")},
                "flood_s": args.flood_s, "clients": args.clients, "batch_facts": args.batch_facts, "b_facts": args.b_facts,
                "max_tokens": args.max_tokens, "memory_mode": "kv", "auth_mode": "keys", "max_backoff_s": args.max_backoff_s,
                "engine": settings["engine"],
            },
        }
        return result


def table(result: dict[str, Any]) -> str:
    rows = [
        ("fairness", result["settings"]["fairness"]),
        ("B chat p50 alone (s)", result["alone_p50_s"]),
        ("  before / after the flood (s)", (result["alone_before_p50_s"], result["alone_after_p50_s"])),
        ("B chat p50 during A's flood (s)", result["during_flood_p50_s"]),
        ("ratio", result["ratio"]),
        ("A's adds by status", result["flood_statuses"]),
        ("A's facts acknowledged", result["a_facts_acknowledged"]),
        ("acknowledged facts lost", result["lost_facts"]),
        ("B's facts without live KV", result["b_facts_evicted"]),
        ("shard afterwards", result["shard_after"]),
        ("load average (1 min, 2 cores)", result["load_average_1m"]),
    ]
    return "\n".join(f"{name:<34} {value}" for name, value in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--unfair", action="store_true", help="fairness settings off (the before measurement)")
    parser.add_argument("--flood-s", type=float, default=40.0, help="seconds of flood")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--batch-facts", type=int, default=16)
    parser.add_argument("--b-facts", type=int, default=8)
    parser.add_argument("--alone-chats", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--arena-pages", type=int, default=96, help="host arena pages: small, so A's facts compete for room")
    parser.add_argument("--max-backoff-s", type=float, default=2.0, help="most seconds A waits after a 429")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--drain-wait-s", type=float, default=90.0, help="most seconds to wait for A's backlog before B chats alone again")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = run(args)
    write_result(args.out or RESULTS / ("tenants_cpu_unfair.json" if args.unfair else "tenants_cpu.json"), result)
    print(table(result))


if __name__ == "__main__":
    main()
