"""The pieces of one fault episode of bench/serve/crash_recovery.py: the clients that watch the
service, the victims found by process title and killed, and what is read afterwards."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.kit.results import REPO as ROOT
from bench.serve import http_measures

KV_KEPT = {"live", "encoding", "queued", "evicted"}  # an acknowledged fact's KV states that are not a loss
# the process each fault kills, by title: Ray and vLLM set them (ray::ShardActor, VLLM::EngineCore)
VICTIMS = {
    "engine_core": lambda title: "EngineCore" in title,
    "replica": lambda title: "ServeReplica:" in title and ":LLMReplica" in title,
    "shard": lambda title: "ShardActor" in title,
}


@dataclass
class Event:
    source: str  # health | chat | add
    sent: float  # time.monotonic()
    done: float
    status: int | str  # HTTP status, "timeout", or the client error's class name
    retry_after: bool = False  # a Retry-After header came with it


class Watchers:
    """The episode's own clients, each in a thread, every answer recorded: /health every 0.2 s,
    a chat (memory kv) of a seeded user every 0.5 s, and an add of one new fact for its own user
    about every add_interval_s (every acknowledged fact id kept)."""

    def __init__(self, url: str, admin_key: str, *, probe_user: str, adder_user: str, top_k: int, max_tokens: int,
                 health_timeout_s: float, request_timeout_s: float, add_interval_s: float) -> None:
        self.url, self.admin_key = url, admin_key
        self.probe_user, self.adder_user = probe_user, adder_user
        self.top_k, self.max_tokens = top_k, max_tokens
        self.health_timeout_s, self.request_timeout_s, self.add_interval_s = health_timeout_s, request_timeout_s, add_interval_s
        self.events: list[Event] = []
        self.acked: list[str] = []
        self.stop_load, self.stop_health = threading.Event(), threading.Event()
        self.threads = [threading.Thread(target=self._health, daemon=True), threading.Thread(target=self._chats, daemon=True),
                        threading.Thread(target=self._adds, daemon=True)]

    def start(self) -> "Watchers":
        for thread in self.threads:
            thread.start()
        return self

    def stop_clients(self) -> None:
        self.stop_load.set()
        for thread in self.threads[1:]:
            thread.join(self.request_timeout_s + 5)

    def stop(self) -> None:
        self.stop_clients()
        self.stop_health.set()
        self.threads[0].join(self.health_timeout_s + 5)

    def client(self, timeout_s: float) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=timeout_s)

    def _call(self, source: str, client: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        sent, response = time.monotonic(), None
        try:
            response = client.request(method, path, **kwargs)
            status: int | str = response.status_code
        except httpx.TimeoutException:
            status = "timeout"
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        retry = response is not None and "retry-after" in response.headers
        self.events.append(Event(source, sent, time.monotonic(), status, retry))
        return response

    def _health(self) -> None:
        with self.client(self.health_timeout_s) as client:
            while not self.stop_health.is_set():
                self._call("health", client, "GET", "/health")
                self.stop_health.wait(0.2)

    def _chats(self) -> None:
        body = {"user": self.probe_user, "messages": [{"role": "user", "content": "What do you remember about me?"}],
                "max_tokens": self.max_tokens, "memory": {"mode": "kv", "top_k": self.top_k}}
        with self.client(self.request_timeout_s) as client:
            while not self.stop_load.is_set():
                self._call("chat", client, "POST", "/v1/chat/completions", json=body, headers={"x-session-id": self.probe_user})
                self.stop_load.wait(0.5)

    def _adds(self) -> None:
        n = 0
        with self.client(self.request_timeout_s) as client:
            while not self.stop_load.is_set():
                n, started = n + 1, time.monotonic()
                fact = f"{self.adder_user} put parcel {n} on shelf {n % 9} of aisle {n * 7 % 13}."
                response = self._call("add", client, "POST", "/v1/memories", json={"user_id": self.adder_user, "facts": [fact]},
                                      headers={"x-session-id": self.adder_user})
                if response is not None and response.status_code == 200:
                    self.acked.extend(r["id"] for r in response.json()["results"])
                self.stop_load.wait(max(0.0, self.add_interval_s - (time.monotonic() - started)))

    def ok_streak(self, since: float) -> int:
        """Chats sent after `since` that answered 200 in a row, counted from the last one back."""
        streak = 0
        for event in reversed([e for e in list(self.events) if e.source == "chat" and e.sent >= since]):
            if event.status != 200:
                break
            streak += 1
        return streak


def recovered_s(events: list[Event], since: float) -> float | None:
    """Seconds from `since` to the answer of the first 200 chat sent after the last failed one (the
    first 200 at all when none failed); None when no chat answered 200 after the failures."""
    chats = sorted((e for e in events if e.source == "chat" and e.sent >= since), key=lambda e: e.sent)
    failed = [e for e in chats if e.status != 200]
    after = failed[-1].sent if failed else since
    ok = [e.done for e in chats if e.status == 200 and e.sent > after]
    return round(min(ok) - since, 2) if ok else None


def status_counts(events: list[Event], start: float, end: float) -> dict[str, dict[str, int]]:
    """Per client: status -> answers that overlap [start, end] (`503 no Retry-After` counted apart)."""
    counts: dict[str, Counter] = {}
    for event in events:
        if event.done >= start and event.sent <= end:
            key = "503 no Retry-After" if event.status == 503 and not event.retry_after else str(event.status)
            counts.setdefault(event.source, Counter())[key] += 1
    return {source: dict(sorted(c.items())) for source, c in sorted(counts.items())}


def slowest(events: list[Event], start: float, end: float) -> dict[str, dict[str, Any]]:
    """Per client, over the answers that overlap [start, end]: how many, the longest and the median seconds."""
    out: dict[str, dict[str, Any]] = {}
    for source in sorted({e.source for e in events}):
        took = sorted(e.done - e.sent for e in events if e.source == source and e.done >= start and e.sent <= end)
        if took:
            out[source] = {"n": len(took), "max_s": round(took[-1], 2), "p50_s": round(took[len(took) // 2], 2)}
    return out


def timeline(events: list[Event], since: float, start: float, end: float) -> list[str]:
    """"+0.30 chat 503 19.47s" (sent, seconds after the fault; client; status; seconds taken) for
    every chat and add in [start, end], and for each /health answer that took over 1 s or whose
    status differs from the one before it."""
    rows, last = [], None
    for e in sorted(events, key=lambda e: e.sent):
        if e.source == "health":
            changed, last = e.status != last, e.status
            if not changed and e.done - e.sent <= 1.0:
                continue
        if e.done >= start and e.sent <= end:
            status = f"{e.status}{' (no Retry-After)' if e.status == 503 and not e.retry_after and e.source != 'health' else ''}"
            rows.append(f"{e.sent - since:+.2f} {e.source} {status} {e.done - e.sent:.2f}s")
    return rows


def health_summary(events: list[Event], timeout_s: float, since: float) -> dict[str, Any]:
    health = [e for e in events if e.source == "health"]
    durations = [(timeout_s if e.status == "timeout" else e.done - e.sent, e) for e in health]
    longest, event = max(durations, key=lambda d: d[0], default=(None, None))
    return {"health_max_s": round(longest, 3) if longest is not None else None,
            "health_max_at_s": round(event.sent - since, 1) if event is not None else None,  # relative to the fault
            "health_polls": len(health), "health_over_1s": sum(1 for d, _ in durations if d > 1.0),
            "health_statuses": dict(Counter(str(e.status) for e in health))}


# ------------------------------------------------------------------------------ Locust
class LocustRun:
    """loadtest/locustfile.py headless in the background (http_measures.locust_command), stopped with
    SIGTERM; its CSVs say how many chats and /health calls it made and what failed."""

    def __init__(self, ctx: http_measures.Context, prefix: Path, *, users: int, pool: int, top_k: int, max_tokens: int,
                 wait_s: float, processes: int, seconds: int) -> None:
        command, env = http_measures.locust_command(ctx, "kv", users, seconds, prefix, "varied", pool=pool, top_k=top_k,
                                                  max_tokens=max_tokens, wait_s=wait_s, processes=processes)
        self.prefix = prefix
        self.log = open(f"{prefix}.log", "w")
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> dict[str, Any]:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the master and its workers
                self.process.wait(10)
        self.log.close()
        return locust_summary(self.prefix)


def locust_summary(prefix: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        for row in csv.DictReader(open(f"{prefix}_stats.csv")):
            if row["Name"] in ("chat", "health") and row["Type"] in ("POST", "GET"):
                out[row["Name"]] = {"requests": int(row["Request Count"]), "failures": int(row["Failure Count"])}
        failures: Counter = Counter()
        for row in csv.DictReader(open(f"{prefix}_failures.csv")):
            found = re.search(r"HTTP (\d{3})|(\d{3}) (?:Server|Client) Error", row["Error"])
            kind = (found.group(1) or found.group(2)) if found else row["Error"][:80]
            failures[f"{row['Name']} {kind}"] += int(row["Occurrences"])
        out["failures"] = dict(failures)
    except (OSError, KeyError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


# ------------------------------------------------------------------------------ processes
def title(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline()).strip() or process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def service_processes(root_pid: int | None) -> list[psutil.Process]:
    """The processes under `serve run` (its Ray cluster is its child), or every process when unknown."""
    try:
        return psutil.Process(root_pid).children(recursive=True) if root_pid else list(psutil.process_iter())
    except psutil.NoSuchProcess:
        return []


def find_victim(fault: str, root_pid: int | None, expected: int = 1, wait_s: float = 60.0) -> psutil.Process:
    """A live process of the service whose title matches the fault, once `expected` of them run
    (several replicas per shard run several engines and replicas; waiting while a restart is under
    way): the oldest."""
    deadline = time.monotonic() + wait_s
    while True:
        found = [p for p in service_processes(root_pid) if VICTIMS[fault](title(p)) and _alive(p)]
        if len(found) == expected or time.monotonic() > deadline:
            if not found:
                raise RuntimeError(f"{fault}: no process matches")
            return min(found, key=lambda p: p.create_time())
        time.sleep(1)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pids(root_pid: int | None) -> dict[str, list[int]]:
    """Who runs now: the pids of each victim kind (after a fault: restarted in place or replaced)."""
    processes = service_processes(root_pid)
    return {fault: [p.pid for p in processes if match(title(p)) and _alive(p)] for fault, match in VICTIMS.items()}


def survivors(processes: list[psutil.Process]) -> list[int]:
    return [p.pid for p in processes if _alive(p)]


# ------------------------------------------------------------------------------ afterwards
def arena_free(stats: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The arenas' free host capacity and what holds the rest, summed over the shards."""
    if stats is None:
        return None
    total = lambda key: sum(int(s.get(key) or 0) for s in stats)  # noqa: E731
    return {"pages_free": total("pages_total") - total("pages_used"), "bytes_free": total("host_bytes_capacity") - total("host_bytes_used"),
            **{key: total(key) for key in ("pages_used", "entries_live", "pins", "entries_writing", "entries_retired", "facts",
                                           "facts_with_kv", "kv_evictions_total", "users_unsure", "encode_failed")}}


def arena_tables_sum(paths: list[Path]) -> dict[str, Any] | None:
    """From the arenas themselves (same machine): pages used by no live entry (a leak once settled)."""
    from kvarena.arena import LIVE, FactArena

    if not paths:
        return None
    out = {"pages_used": 0, "live_entry_pages": 0, "leaked_pages": 0, "pins": 0}
    for path in paths:
        arena = FactArena.open(path)
        try:
            with arena.locked():
                live, usage = int(arena.entries[arena.entries["state"] == LIVE]["n_pages"].sum()), arena.usage()
        finally:
            arena.close()
        for key, value in (("pages_used", usage["pages_used"]), ("live_entry_pages", live),
                           ("leaked_pages", usage["pages_used"] - live), ("pins", usage["pins"])):
            out[key] += value
    return out


def check_facts(client: httpx.Client, user: str, acked: list[str], top_k: int, max_tokens: int) -> dict[str, Any]:
    """Every acknowledged fact listed, its KV not lost, and a kv chat answered from them."""
    out: dict[str, Any] = {"acked_facts": len(acked)}
    response = client.get("/v1/memories", params={"user_id": user}, headers={"x-session-id": user})
    if response.status_code != 200:
        return {**out, "lost_facts": None, "facts_error": f"list: HTTP {response.status_code}: {response.text[:300]}"}
    records = {r["id"]: r for r in response.json()["results"]}
    out["lost_facts"] = [fact for fact in acked if fact not in records]
    out["kv_states"] = dict(Counter(records[f]["kv"] for f in acked if f in records))
    out["kv_not_kept"] = [(f, records[f]["kv"], records[f].get("kv_error")) for f in acked if f in records and records[f]["kv"] not in KV_KEPT]
    out["unacked_listed"] = len(set(records) - set(acked))  # written, reply lost: Redis has it (read repair)
    k = max(1, min(len(acked), top_k))
    body = {"user": user, "messages": [{"role": "user", "content": "Which shelf holds parcel 3?"}], "max_tokens": max_tokens,
            "memory": {"mode": "kv", "top_k": k}}
    answer = client.post("/v1/chat/completions", json=body, headers={"x-session-id": user})
    out["answer_status"] = answer.status_code
    if answer.status_code == 200:
        memory = answer.json().get("memory") or {}
        out["answered_from"] = len(set(memory.get("fact_ids") or []) & set(acked))
        out["answer_top_k"] = k
        out["answer_injected_tokens"] = memory.get("injected_tokens")
    return out


def bad_statuses(episode: dict[str, dict[str, int]], locust: dict[str, Any]) -> dict[str, int]:
    """What clients saw that a fault must not show them: anything but 200 and 503 with Retry-After
    (timeouts, connection errors, 500s), from the prober, the adder and Locust's chats."""
    bad = {f"{source} {status}": n for source in ("chat", "add") for status, n in episode.get(source, {}).items()
           if status not in ("200", "503")}
    bad.update({f"locust {kind}": n for kind, n in (locust.get("failures") or {}).items()
                if kind.startswith("chat") and kind != "chat 503"})
    return bad


def row(fault: str, r: dict[str, Any]) -> str:
    """One line of the table: what a fault cost."""
    if "skipped" in r:
        return f"{fault:<12} skipped: {r['skipped']}"
    before, after = r.get("arena_before") or {}, r.get("arena_after") or {}
    gap = {source: counts for source, counts in r.get("statuses", {}).items() if source in ("chat", "add")}
    lost = r.get("lost_facts")
    return (f"{fault:<12} {r.get('recovered_s')!s:>9} {r.get('health_max_s')!s:>8} {r.get('health_over_1s')!s:>5} "
            f"{(len(lost) if lost is not None else '?')!s:>4}/{r.get('acked_facts')!s:<5} "
            f"{before.get('pages_free')!s:>6}->{after.get('pages_free')!s:<6} "
            f"{(r.get('arena_tables_after') or {}).get('leaked_pages')!s:>6}  {json.dumps(gap)} bad {json.dumps(r.get('bad_statuses'))}"
            + ("" if r.get("recovered") else "  NOT RECOVERED") + (" (fresh start before)" if r.get("fresh_start") else "")
            + (f"  error: {r['error'][:200]}" if r.get("error") else ""))


def table(result: dict[str, Any]) -> str:
    lines = [f"{'fault':<12} {'recovered':>9} {'health':>8} {'>1s':>5} {'lost/acked':<10} {'free pages':<14} {'leaked':>6}  "
             "statuses in the gap (prober, adder)"]
    lines += [row(fault, result[fault]) for fault in ("engine_core", "replica", "shard", "redis") if fault in result]
    run = result.get("run") or {}
    if run.get("error"):
        lines.append(f"run error: {run['error'][:500]}")
    return "\n".join(lines)
