"""Data preparation of the engine benchmark (bench/engine/engine_h200.py), on a CPU machine: LoCoMo
token ids and the SmolLM2 GGUF in two parts; on the GPU machine: the GGUF back to a bf16 folder."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.engine.engine_h200_common import GGUF_NAME, INSTRUCTION


def prepare_data(data_dir: Path, gguf_dir: Path, n_equiv: int = 50, equiv_facts: int = 20) -> None:
    import random

    from transformers import AutoTokenizer

    from bench.quality.locomo_qa import DEFAULT_LOCOMO, NO_LOCOMO
    from devtools.offline_models import prepare_smollm2, smollm2_gguf_path

    tokenizer = AutoTokenizer.from_pretrained(prepare_smollm2())
    conversations = json.loads((DEFAULT_LOCOMO or sys.exit(NO_LOCOMO)).read_text())  # $KVMEM_LOCOMO

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prefix_text = f"<|im_start|>system\n{INSTRUCTION}"
    query_text = "<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
    facts, per_conversation = [], []
    questions = []
    for conversation in conversations:
        mine = []
        for session in conversation["observation"].values():
            for speaker_facts in session.values():
                for fact, dia_id in speaker_facts:
                    mine.append((f"- {fact}\n", dia_id if isinstance(dia_id, str) else ""))
        per_conversation.append(mine)
        facts.extend(ids(text) for text, _ in mine)
        for qa in conversation["qa"]:
            if qa.get("category") != 5:
                questions.append((len(per_conversation) - 1, qa))
    rng = random.Random(0)
    rng.shuffle(questions)
    query_ids = [ids(query_text.format(q=qa["question"])) for _, qa in questions[:600]]
    equiv = []
    for conv_index, qa in questions[:n_equiv]:
        mine = per_conversation[conv_index]
        evidence = set(qa.get("evidence") or [])
        chosen = [f for f in mine if f[1] in evidence][:equiv_facts]
        others = [f for f in mine if f not in chosen]
        chosen += rng.sample(others, min(len(others), equiv_facts - len(chosen)))
        rng.shuffle(chosen)
        memory = ids(prefix_text + "".join(text for text, _ in chosen))
        equiv.append({"memory": memory, "query": ids(query_text.format(q=qa["question"]))})
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "locomo_tokens.json").write_text(
        json.dumps({"prefix": ids(prefix_text), "facts": facts, "queries": query_ids, "equiv": equiv, "tokenizer": "SmolLM2-135M-Instruct"})
    )
    lengths = [len(f) for f in facts]
    print(f"{len(facts)} facts: mean {statistics.mean(lengths):.1f} tokens, median {statistics.median(lengths)}, max {max(lengths)}")
    gguf = smollm2_gguf_path()
    blob = gguf.read_bytes()
    gguf_dir.mkdir(parents=True, exist_ok=True)
    half = len(blob) // 2
    (gguf_dir / "part-0").write_bytes(blob[:half])
    (gguf_dir / "part-1").write_bytes(blob[half:])
    print(f"wrote {data_dir}/locomo_tokens.json and {gguf_dir}/part-0, part-1 ({len(blob)} bytes)")


def convert_smollm2(gguf_dir: Path, target: Path) -> Path:
    if (target / "model.safetensors").exists():
        return target
    # gguf imports mistral_common when present; the staged one fails on import (no pycountry)
    # with a RuntimeError that gguf does not catch: make it a plain ImportError for the conversion
    hidden = "mistral_common" not in sys.modules
    if hidden:
        sys.modules["mistral_common"] = None  # type: ignore[assignment]
    from transformers import AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="gguf-"))
    with open(work / GGUF_NAME, "wb") as f:
        for part in sorted(gguf_dir.glob("part-*")):
            f.write(part.read_bytes())
    model = AutoModelForCausalLM.from_pretrained(work, gguf_file=GGUF_NAME, dtype="bfloat16")  # as devtools.offline_models
    if getattr(model, "hf_quantizer", None) is not None:
        del model.hf_quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target)
    if hidden:
        del sys.modules["mistral_common"]
    return target
