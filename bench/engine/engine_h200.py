"""Engine-level benchmark of KV injection on one H200 (vLLM 0.25.1): TTFT, QPS, bf16 equivalence.

Three parts, each in its own process (a failing part is recorded and the others still run):

smoke     the Triton kernel tests on the GPU (tests/test_triton_inject.py, compiled, not
          interpreted) and kernel micro-timings at the Llama-3.1-8B shape: fused inject from
          HBM, host-tier rows over PCIe (pinned, mapped), a plain pinned DMA for reference.
engine8b  Llama-3.1-8B architecture (bench/engine/llama31_8b_config.json, the public config),
          load_format="dummy", bf16, prefix caching on, default compilation config (torch.compile
          + CUDA graphs). Memory facts: LoCoMo observation facts (token ids from the SmolLM2
          tokenizer), captured through the connector into the arena.
          TTFT (one request, max_tokens=1, wall clock around LLM.generate, median of --requests)
          vs k in {5, 10, 20, 50} for: none ([instruction][question]), prompt ([instruction]
          [k facts][question] prefilled), kv_hbm (the same tokens, instruction and facts injected
          from the HBM tier), kv_host (the same, the request's own entries demoted from the HBM tier
          just before it: injected from the pinned host tier). Modes interleave request by request.
          QPS: batches of 10/25/50/75/100 users x 2 questions, k = 50, 50 output tokens.
equiv     SmolLM2-135M-Instruct with its real weights (GGUF converted on the machine), bf16:
          50 LoCoMo prompts [system + 20 facts of the conversation][question]; the memory is
          captured jointly, then injected (HBM tier, and host tier) vs prompt injection: share
          of identical 32-token greedy continuations, largest first-token logprob gap.

    # on a CPU machine, once: token ids and the GGUF in ignored folders
    .venv/bin/python -m bench.engine.engine_h200 --prepare-data
    # on the GPU machine (see docs/gpu.md for the whole call sequence)
    python3 -m bench.engine.engine_h200 --all --out $OUT
    # bf16 fidelity alone, with and without VLLM_BATCH_INVARIANT=1 (bench/engine/engine_h200_equiv.py)
    python3 -m bench.engine.engine_h200 --fidelity --smollm2 <a bf16 SmolLM2 folder> --out $OUT

Writes OUT/engine_h200.json ({"ttft_ms": ..., "qps": ..., "bf16_identical_share": ...} plus
details), OUT/engine_h200.png and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench.engine.engine_h200_common import DATA, GGUF_PARTS, K_VALUES, REPO, USERS, write_json
from bench.engine.engine_h200_data import prepare_data
from bench.engine.engine_h200_equiv import part_equiv
from bench.engine.engine_h200_parts import part_engine8b, part_smoke
from bench.engine.engine_h200_report import merge, plot, table


def run_part(part: str, budget_s: float) -> None:
    """One part in a process of its own (a failing part is recorded and the others still run)."""
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "bench.engine.engine_h200", "--part", part, *(a for a in sys.argv[1:] if a not in ("--all", "--fidelity"))]
    try:
        rc = subprocess.run(cmd, cwd=REPO, timeout=budget_s).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    print(f"[bench] part {part}: rc {rc} in {time.perf_counter() - started:.0f} s", flush=True)


def fidelity(args: argparse.Namespace) -> None:
    """bf16 fidelity with and without batch invariance, side by side: OUT/bf16_fidelity_h200.json."""
    for part in ("equiv", "equiv_bi"):
        run_part(part, 280)
    keys = ("identical_share_hbm", "identical_share_host", "max_first_token_logprob_gap_hbm", "identical_share_hbm_vs_prefix_cached",
            "max_gap_hbm_vs_prefix_cached", "control_identical_share_prefix_cached", "control_max_gap_prefix_cached",
            "identical_share_relocated", "identical_share_relocated_vs_hbm", "max_first_token_logprob_gap_relocated", "speed",
            "injected_all", "injected_all_relocated", "relocated_error", "error")
    result: dict = {"where": "H200, bench/engine/engine_h200.py --fidelity", "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for part, name in (("equiv", "default"), ("equiv_bi", "batch_invariant")):
        path = args.out / f"part_{part}.json"
        found = json.loads(path.read_text()) if path.exists() else {"error": "no result"}
        result[name] = {k: found[k] for k in keys if k in found}
        result[name]["prompts"] = found.get("prompts")
        checks = found.get("split_checks")
        if checks:  # bench/engine/engine_h200_readback.py: the per-prompt rows stay in OUT/part_*.json
            result[name]["split_checks"] = {k: v for k, v in checks.items() if k != "rows"}
        if "split_checks_error" in found:
            result[name]["split_checks_error"] = found["split_checks_error"]
    write_json(args.out / "bf16_fidelity_h200.json", result)
    print(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare-data", action="store_true")
    parser.add_argument("--all", action="store_true", help="run every part (subprocesses), merge, print, plot")
    parser.add_argument("--part", choices=("smoke", "engine8b", "equiv", "equiv_bi"))
    parser.add_argument("--fidelity", action="store_true",
                        help="parts equiv and equiv_bi (VLLM_BATCH_INVARIANT=1) only: OUT/bf16_fidelity_h200.json")
    parser.add_argument("--merge", action="store_true")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--gguf", type=Path, default=Path("/tmp/gguf"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pool", type=int, default=600)
    parser.add_argument("--equiv", type=int, default=50)
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out with --all")
    parser.add_argument("--skip-qps", action="store_true", help="engine8b: TTFT only, no throughput batches")
    parser.add_argument("--model-config", type=Path, default=REPO / "bench" / "engine" / "llama31_8b_config.json")
    parser.add_argument("--k", type=lambda v: [int(x) for x in v.split(",")], default=list(K_VALUES))
    parser.add_argument("--users", type=lambda v: [int(x) for x in v.split(",")], default=list(USERS))
    parser.add_argument("--smollm2", type=Path, default=None, help="a converted SmolLM2 folder (skips the GGUF conversion)")
    parser.add_argument("--block-size", type=int, default=None, help="engine8b: vLLM's KV block size (default: vLLM's, 16 on a GPU)")
    parser.add_argument("--eager", action="store_true", help="enforce_eager engines: only for a dry run on a CPU machine")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with callables
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.prepare_data:
        prepare_data(args.data, GGUF_PARTS)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "equiv_bi":
        os.environ["VLLM_BATCH_INVARIANT"] = "1"  # before vLLM is imported: it reads its envs once
    if args.part:
        try:
            result = {"smoke": part_smoke, "engine8b": part_engine8b, "equiv": part_equiv, "equiv_bi": part_equiv}[args.part](args)
            write_json(args.out / f"part_{args.part}.json", result)
        except Exception as exc:  # noqa: BLE001 - recorded; the orchestrator goes on
            traceback.print_exc()
            path = args.out / f"part_{args.part}.json"
            previous = json.loads(path.read_text()) if path.exists() else {}
            previous["error"] = "".join(traceback.format_exception(exc))[-3000:]
            write_json(path, previous)
            sys.exit(1)
        return
    if args.fidelity:
        fidelity(args)
        return
    if args.all:
        budgets = {"smoke": 200, "engine8b": 330, "equiv": 420}
        skip = set(filter(None, args.skip.split(",")))
        for part, budget in budgets.items():
            if part in skip:
                continue
            run_part(part, budget)
    if args.all or args.merge:
        result = merge(args.out)
        print(table(result))
        try:
            plot(result, args.out / "engine_h200.png")
        except Exception as exc:  # noqa: BLE001
            print("plot failed:", exc)
        print(json.dumps({k: result[k] for k in ("ttft_ms", "qps", "bf16_identical_share")}))


if __name__ == "__main__":
    main()
