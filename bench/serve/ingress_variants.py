"""Issue 39's ingress variants side by side: merges what bench/serve/ingress_variants.sh left in
its folder (one serve_<card>.json per variant, each from bench.serve.serve_http on the same card in
one visit) into bench/results/serve_<card>_ingress.json and prints the table: TTFT through HTTP
against the engine's own at k = 50, Serve's floor, Locust chats/s at the most users per mode, the
wait before the replica and the shard hop under load against one at a time.

    python -m bench.serve.ingress_variants OUT [--into bench/results]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.kit.results import card_tag, read_json, table, write_result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the issue compares, from one variant's serve_<card>.json (None where not measured)."""
    http, engine = result.get("http_ttft_ms", {}), result.get("engine_ttft_ms", {})
    qps = result.get("locust_qps_varied", {})
    server = result.get("locust_server_ms_varied", {}).get("kv", {})
    most = max(server, key=int, default=None)
    under_load = server.get(most, {}) if most else {}
    alone = result.get("stages_ms", {}).get("kv", {}).get("50", {})
    top = {mode: by_users.get(max(by_users, key=int)) if by_users else None for mode, by_users in qps.items()}
    return {
        "startup_s": result.get("startup_s"),
        "http_ttft_kv_k50_ms": http.get("kv", {}).get("50"), "engine_ttft_kv_k50_ms": engine.get("kv", {}).get("50"),
        "serve_floor_ms": result.get("serve_floor_ms"),
        "locust_users": int(most) if most else None, "qps": top,
        "kv_over_prompt": round(top["kv"] / top["prompt"], 2) if top.get("kv") and top.get("prompt") else None,
        "outside_replica_p50_ms": (under_load.get("outside_replica") or [None])[0],
        "shard_hop_p50_ms": {"one_at_a_time": alone.get("shard_hop"), "under_load": (under_load.get("shard_hop") or [None])[0]},
        "errors": result.get("errors"),
    }


def merge(folder: Path) -> dict[str, Any]:
    variants: dict[str, Any] = {}
    card = None
    for path in sorted(folder.glob("*/serve_*.json")):
        result = read_json(path)
        card = card or result.get("card")
        environment = (path.parent / "environment").read_text().split() if (path.parent / "environment").exists() else []
        variants[path.parent.name] = {"environment": environment, "summary": summary(result), "result": result}
    return {"card": card, "command": "bash bench/serve/ingress_variants.sh OUT (then python -m bench.serve.ingress_variants OUT)",
            "config": "config.gpu.yaml", "variants": variants}


def report(merged: dict[str, Any]) -> str:
    rows = []
    for name, variant in merged["variants"].items():
        s = variant["summary"]
        rows.append([name, s["startup_s"], s["http_ttft_kv_k50_ms"], s["engine_ttft_kv_k50_ms"], s["serve_floor_ms"],
                     *(s["qps"].get(mode) for mode in ("kv", "prompt", "none")), s["kv_over_prompt"], s["outside_replica_p50_ms"],
                     s["shard_hop_p50_ms"]["one_at_a_time"], s["shard_hop_p50_ms"]["under_load"]])
    return f"{merged['card']}\n" + table(rows, ["variant", "start s", "http kv ms", "engine kv ms", "floor ms", "kv qps", "prompt qps",
                                                "none qps", "kv/prompt", "outside p50", "hop 1", "hop load"], ".1f")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the OUT folder bench/serve/ingress_variants.sh wrote")
    parser.add_argument("--into", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    merged = merge(args.folder)
    if not merged["variants"]:
        parser.error(f"no <variant>/serve_*.json under {args.folder}")
    write_result(args.into / f"serve_{card_tag(merged['card'])}_ingress.json", merged)
    print(report(merged))


if __name__ == "__main__":
    main()
