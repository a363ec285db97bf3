"""Per-key limits across several ingress processes (issue 36): one key's reads through two ChatAPI
replicas, against its configured rate. Usage: docs/bench.md."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.kit.results import RESULTS, write_result
from bench.serve.tenants_flood import running_service


def hammer(url: str, key: str, seconds: float, threads: int) -> tuple[Counter[str], list[float]]:
    """Statuses of reads sent as fast as answered, and when each 200 came (seconds from the start)."""
    statuses: Counter[str] = Counter()
    admitted: list[float] = []
    lock = threading.Lock()
    started = time.perf_counter()

    def loop() -> None:
        with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as client:
            while (now := time.perf_counter() - started) < seconds:
                answer = client.get("/v1/memories", params={"user_id": "ann"})
                with lock:
                    statuses[str(answer.status_code)] += 1
                    if answer.status_code == 200:
                        admitted.append(now)
                if answer.status_code == 429:  # as told: a client that honours Retry-After, at the most it may have
                    time.sleep(float(answer.headers.get("Retry-After", "1")))

    workers = [threading.Thread(target=loop) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return statuses, sorted(admitted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ingress-replicas", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=8, help="clients of the key at once: the limit, not the client, sets the pace")
    parser.add_argument("--out", type=Path, default=RESULTS / "admission_spread_cpu.json")
    args = parser.parse_args()
    service = argparse.Namespace(timeout_s=120.0, unfair=False, arena_pages=None)
    with running_service(service, hostile=True, ingress_replicas=args.ingress_replicas) as (client, keys, settings):
        url = str(client.base_url).rstrip("/")
        reads = settings["admission"]["per_user"]["reads"]
        hammer(url, keys["ann"], 5.0, args.threads)  # both processes learn the key is spread (and the burst is spent)
        time.sleep(3.0)  # a quiet spell: the bucket refills to its burst
        load = os.getloadavg()[0]
        statuses, admitted = hammer(url, keys["ann"], args.seconds, args.threads)
    one_process = reads["burst"] + reads["per_s"] * args.seconds  # what one process grants at most in the window
    steady = [t for t in admitted if t >= 5.0]  # after the burst: the rate alone
    steady_rate = len(steady) / (args.seconds - 5.0)
    result: dict[str, Any] = {
        "command": f"python -m bench.serve.admission_spread --ingress-replicas {args.ingress_replicas} --seconds {args.seconds:g} --threads {args.threads}",
        "ingress_replicas": args.ingress_replicas, "seconds": args.seconds, "threads": args.threads,
        "configured": {"per_s": reads["per_s"], "burst": reads["burst"]},
        "statuses": dict(statuses), "admitted": len(admitted), "allowed_by_the_rate": one_process,
        "admitted_over_allowed": round(len(admitted) / one_process, 2),
        "steady_admitted_per_s": round(steady_rate, 2), "steady_over_rate": round(steady_rate / reads["per_s"], 2),
        "without_a_share_up_to": one_process * args.ingress_replicas, "load_average_1m": load,
    }
    print(json.dumps(write_result(args.out, result), indent=1))


if __name__ == "__main__":
    main()
