"""Turn-by-turn ingest through the RUNNING service's HTTP API, as a chat app adds memory. Usage and
what is reported: docs/bench.md."""

from __future__ import annotations

import argparse
import uuid
from pathlib import Path
from typing import Any

from bench.kit.results import table, write_result
from bench.kit.stage import DEFAULT_LOCOMO
from bench.quality.locomo_qa import Service, ingest, load_conversations, wait_for_encodes


def one_way(service: Service, args: argparse.Namespace, wait_for_kv: bool, max_turns: int | None) -> dict[str, Any]:
    tag = f"ingest-{'wait' if wait_for_kv else 'durable'}-{uuid.uuid4().hex[:6]}"
    (conversation,) = load_conversations(args.locomo, [args.conversation], tag, max_turns, 0)
    try:
        added = ingest(service, [conversation], extract=False, wait_for_kv=wait_for_kv)
        encoded = wait_for_encodes(service, args.timeout_s, args.poll_s)
    finally:
        if not args.keep:
            service.call("DELETE", "/v1/memories", params={"user_id": conversation.user_id})
    return {
        "wait_for_kv": wait_for_kv,
        "turns": len(conversation.turns),
        "adds": added["adds"],
        "facts": added["facts"],
        "seconds": added["seconds"],
        "per_add_p50_ms": added["add_latency_ms"]["p50"],
        "per_add_p90_ms": added["add_latency_ms"]["p90"],
        "per_add_p99_ms": added["add_latency_ms"]["p99"],
        "adds_with_facts": added["adds_with_facts"],
        "per_fact_add_p50_ms": added["add_with_facts_latency_ms"]["p50"],
        "per_fact_add_p90_ms": added["add_with_facts_latency_ms"]["p90"],
        "kv_live_after_last_add_s": encoded["encode_wait_s"],
        **{key: value for key, value in encoded.items() if key.startswith("shard_")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--api-key", default=None, help="an admin key when auth.mode is keys (/v1/shards is an admin route)")
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO, required=DEFAULT_LOCOMO is None, help="default: $KVMEM_LOCOMO")
    parser.add_argument("--conversation", type=int, default=0)
    parser.add_argument("--max-turns", type=int, default=None, help="ingest only the first N turns (default: all)")
    parser.add_argument("--compare-turns", type=int, default=60, help="turns ingested with wait_for_kv (0: skip)")
    parser.add_argument("--poll-s", type=float, default=0.2)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--keep", action="store_true", help="keep the ingested memory (default: deleted after)")
    parser.add_argument("--label", default="cpu", help="where it ran, recorded in the JSON")
    parser.add_argument("--out", type=Path, default=Path("bench/results/ingest_cpu.json"))
    args = parser.parse_args()

    service = Service(args.url, args.api_key, timeout_s=600.0, connections=4)
    runs = [one_way(service, args, wait_for_kv=False, max_turns=args.max_turns)]
    if args.compare_turns:
        runs.append(one_way(service, args, wait_for_kv=True, max_turns=args.compare_turns))
    durable = runs[0]
    doc: dict[str, Any] = {
        "label": args.label,
        "conversation": args.conversation,
        "command": "python -m bench.ingest.ingest_turns " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                             if k in ("conversation", "max_turns", "compare_turns", "label") and v is not None),
        "per_add_p50_ms": durable["per_add_p50_ms"],
        "kv_live_after_last_add_s": durable["kv_live_after_last_add_s"],
        "runs": runs,
    }
    doc["per_fact_add_p50_ms"] = durable["per_fact_add_p50_ms"]
    if len(runs) == 2 and durable["per_fact_add_p50_ms"]:
        doc["wait_over_durable_fact_add_p50"] = round(runs[1]["per_fact_add_p50_ms"] / durable["per_fact_add_p50_ms"], 1)

    keys = ("turns", "facts", "per_add_p50_ms", "per_add_p90_ms", "per_add_p99_ms", "adds_with_facts", "per_fact_add_p50_ms",
            "per_fact_add_p90_ms", "seconds", "kv_live_after_last_add_s")
    print(table([["wait_for_kv" if r["wait_for_kv"] else "durable", *(r[k] for k in keys)] for r in runs],
                ["add", "turns", "facts", "p50 ms", "p90 ms", "p99 ms", "fact adds", "p50 ms", "p90 ms", "total s", "KV live after s"], ".1f"))
    if "wait_over_durable_fact_add_p50" in doc:
        print(f"adds carrying facts, p50: waiting for the KV is {doc['wait_over_durable_fact_add_p50']}x the durable acknowledgement")
    write_result(args.out, doc)


if __name__ == "__main__":
    main()
