"""Evidence recall of LoCoMo questions over the conversations' observation facts, per retriever
(bench/retrieval/locomo_retrievers.py), and CPU search latency. Definitions and usage:
docs/bench.md."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench.kit.results import RESULTS, percentiles, progress, table, write_result
from bench.kit.stage import DEFAULT_LOCOMO
from bench.quality.locomo_scoring import evidence_ids
from bench.retrieval.locomo_retrievers import (KS, coverage, evaluate_retrievers, halves, oracle_bounds, print_tables,
                                               search_latency, second_stage_alternatives, summarise, tune)
from memory.embedder import Embedder
from memory.index import ExactIndex


def load_conversations(path: Path) -> tuple[list[dict], dict[str, int]]:
    """Facts (text, source turns) and non-adversarial questions (text, evidence) per conversation."""
    data = json.loads(path.read_text())
    quirks: dict[str, int] = defaultdict(int)
    convs = []
    for conv in data:
        # turn id -> its text as bench/ingest/ingest_locomo.py records it (text, then any shared image's caption)
        turn_text = {
            t["dia_id"]: t["text"] + (f" [shares {t['blip_caption']}]" if t.get("blip_caption") else "")
            for key, val in conv["conversation"].items()
            if key.startswith("session_") and isinstance(val, list)
            for t in val
        }
        turns = set(turn_text)
        facts = []
        for session, by_speaker in sorted(conv.get("observation", {}).items(), key=lambda kv: int(re.findall(r"\d+", kv[0])[0])):
            if not isinstance(by_speaker, dict):
                quirks["observation_session_not_a_dict"] += 1
                continue
            for speaker, items in by_speaker.items():
                for i, item in enumerate(items):
                    if not (isinstance(item, (list, tuple)) and len(item) == 2):
                        quirks["fact_malformed"] += 1
                        continue
                    text, raw = item
                    if isinstance(raw, list):
                        quirks["fact_source_list"] += 1
                    elif isinstance(raw, str) and len(evidence_ids(raw)) > 1:
                        quirks["fact_source_several_ids_in_one_string"] += 1
                    src = [s for s in evidence_ids(raw) if s in turns]
                    if not src:
                        quirks["fact_without_valid_source"] += 1
                    facts.append({
                        "id": f"{conv['sample_id']}/{session}/{speaker}/{i}",
                        "text": str(text),
                        "src": set(src),
                        "source_id": src[0] if src else None,  # the first cited turn, as bench/ingest/ingest_locomo.py stores it
                        "session_time": conv["conversation"].get(f"session_{int(re.findall(r'[0-9]+', session)[0])}_date_time"),
                    })  # fmt: skip
        questions = []
        for qi, qa in enumerate(conv["qa"]):
            if qa.get("category") == 5:
                continue
            evidence: set[str] = set()
            for raw in qa.get("evidence", []):
                ids = evidence_ids(raw)
                if not ids:
                    quirks["evidence_entry_unparseable"] += 1
                    continue
                if len(ids) > 1:
                    quirks["evidence_entry_several_ids"] += 1
                if not str(raw).startswith(ids[0]) or str(raw) != str(raw).strip():
                    quirks["evidence_entry_rewritten"] += 1
                for e in ids:
                    if e in turns:
                        evidence.add(e)
                    else:
                        quirks["evidence_id_not_in_conversation"] += 1
            if not evidence:
                quirks["question_without_valid_evidence_skipped"] += 1
                continue
            questions.append({"n": qi, "text": qa["question"], "evidence": evidence, "category": int(qa["category"])})
        convs.append({"id": conv["sample_id"], "facts": facts, "questions": questions, "turns": turn_text})
    return convs, dict(quirks)


def embed_all(embedder: Embedder, texts: list[str], desc: str, batch: int = 128) -> np.ndarray:
    out = np.zeros((len(texts), embedder.dim), dtype=np.float32)
    with progress(total=len(texts), desc=desc, unit="text") as bar:
        for i in range(0, len(texts), batch):
            out[i : i + batch] = embedder.embed(texts[i : i + batch])
            bar.update(len(texts[i : i + batch]))
    return out


def latency_ms(ts: list[float]) -> dict[str, float]:
    return {**percentiles(ts, (50, 95), 1e3, 4, "_ms"), "mean_ms": round(float(np.mean(ts)) * 1e3, 4), "n": len(ts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO, required=DEFAULT_LOCOMO is None, help="locomo8.json / locomo10.json; default: $KVMEM_LOCOMO")
    ap.add_argument("--out", type=Path, default=RESULTS / "locomo_recall.json")
    ap.add_argument("--model", type=Path, default=None, help="sentence-transformers folder (default: packaged all-MiniLM-L6-v2)")
    ap.add_argument("--latency-facts", type=int, default=2000)
    ap.add_argument("--latency-queries", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--tune", action="store_true", help="also run the grid the retrieval defaults were chosen from (conversations 0-3)")
    ap.add_argument("--embeddings-cache", type=Path, default=None, help="npz to read the embeddings from / write them to")
    args = ap.parse_args()

    convs, quirks = load_conversations(args.locomo)
    t0 = time.perf_counter()
    embedder = Embedder(args.model, device="cpu")
    load_s = time.perf_counter() - t0
    facts = [f for c in convs for f in c["facts"]]
    questions = [(c["id"], q) for c in convs for q in c["questions"]]
    t0 = time.perf_counter()
    if args.embeddings_cache is not None and args.embeddings_cache.exists():
        cached = np.load(args.embeddings_cache)
        fact_vecs, q_vecs = cached["facts"], cached["questions"]
        assert fact_vecs.shape[0] == len(facts) and q_vecs.shape[0] == len(questions), "stale --embeddings-cache"
    else:
        fact_vecs = embed_all(embedder, [f["text"] for f in facts], "embedding facts")
        q_vecs = embed_all(embedder, [q["text"] for _, q in questions], "embedding questions")
        if args.embeddings_cache is not None:
            np.savez(args.embeddings_cache, facts=fact_vecs, questions=q_vecs)
    embed_s = time.perf_counter() - t0

    index = ExactIndex(embedder.dim, "cpu")
    owners = [c["id"] for c in convs for _ in c["facts"]]
    index.add([f["id"] for f in facts], owners, fact_vecs)
    src_of = {f["id"]: f["src"] for f in facts}

    # ---- evidence recall
    rows, ceiling = [], []
    for (conv_id, q), qv in zip(questions, q_vecs):
        hits = index.search(conv_id, qv, max(KS))[0]
        all_src = set().union(*(src_of[f] for f in index.fact_ids(conv_id)))
        ceiling.append(len(q["evidence"] & all_src) / len(q["evidence"]))
        rows.append((q["category"], coverage(src_of, [h.fact_id for h in hits], q["evidence"])))
    dense = summarise(rows)
    recall = {f"@{k}": {"recall": dense[f"recall@{k}"], "hit": dense[f"hit@{k}"]} for k in KS}
    by_category = dense["by_category"]

    # ---- exact CPU latency, 2,000-fact user
    lat_vecs = fact_vecs[: args.latency_facts]
    index.add([f"lat/{f['id']}" for f in facts[: args.latency_facts]], ["latency-user"] * len(lat_vecs), lat_vecs)
    queries = [q_vecs[i % len(q_vecs)] for i in range(args.latency_queries)]
    latency: dict[str, Any] = {
        "user_facts": index.count("latency-user"),
        "index_facts_total": len(index),
        "queries": len(queries),
        "warmup": args.warmup,
        "source": f"first {len(lat_vecs)} of the {len(facts)} real observation facts of all {len(convs)} conversations; queries = real LoCoMo questions",
    }
    threads0 = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for k in (10, 50):
            for q in queries[: args.warmup]:
                index.search("latency-user", q, k)
            ts = []
            for q in queries:
                t = time.perf_counter()
                index.search("latency-user", q, k)
                ts.append(time.perf_counter() - t)
            latency[f"threads{threads}_k{k}"] = latency_ms(ts)
    torch.set_num_threads(threads0)
    # Query embedding, for scale (one question at a time, the embedding model on the CPU).
    ts = []
    for _, q in questions[:5]:
        embedder.embed(q["text"])
    for _, q in questions[:200]:
        t = time.perf_counter()
        embedder.embed(q["text"])
        ts.append(time.perf_counter() - t)
    latency["query_embedding_cpu"] = latency_ms(ts)
    model_name = "all-MiniLM-L6-v2" if args.model is None else embedder.model_path.name

    # ---- per retriever (memory.retrieval, the shard's code), per category, both halves
    retrievers = evaluate_retrievers(convs, fact_vecs, q_vecs)
    tuning = tune(convs, fact_vecs, q_vecs) if args.tune else None
    oracle = oracle_bounds(convs, fact_vecs, q_vecs)
    alternatives = second_stage_alternatives(convs, fact_vecs, q_vecs)
    hybrid_latency = search_latency(convs, fact_vecs, q_vecs, args.latency_queries, args.warmup)

    result = {
        "command": "python -m bench.retrieval.locomo_recall " + " ".join(sys.argv[1:]),
        "data": str(args.locomo),
        "model": model_name,
        "model_path": str(embedder.model_path),
        "embedding_dim": embedder.dim,
        "conversations": len(convs),
        "facts": len(facts),
        "questions": len(questions),
        "definitions": {
            "recall@k": "|E ∩ covered_k| / |E| averaged over questions; E = evidence dia_ids, covered_k = source dia_ids of the top-k facts",
            "hit@k": "share of questions with at least one evidence dia_id covered by the top-k facts",
            "ceiling": "recall with all of the conversation's facts retrieved",
        },
        "data_quirks": quirks,
        "recall_retriever": "dense (ExactIndex alone; per retriever: 'retrievers')",
        "recall": recall,
        "ceiling_recall": round(float(np.mean(ceiling)), 4),
        "recall_by_category": by_category,
        "category_names": {"1": "multi-hop", "2": "temporal", "3": "open-domain", "4": "single-hop"},
        "latency": latency,
        "retrievers": retrievers,
        "retrievers_protocol": "RetrievalSettings defaults chosen on the first half of the conversations (0-3; grid: 'tuning', "
        "from --tune); the second half (4-7) took no part in the choice",
        "hybrid_search_latency_cpu": hybrid_latency,
        "oracle_rerank_recall@10": oracle,
        "second_stage_alternatives": alternatives,
        **({"tuning": tuning} if tuning is not None else {}),
        "embedding": {"model_load_s": round(load_s, 2), "embed_facts_and_questions_s": round(embed_s, 2), "texts": len(facts) + len(questions)},
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "load_average_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
        },
    }
    write_result(args.out, result)

    print(f"\n{len(convs)} conversations, {len(facts)} facts, {len(questions)} questions (category 1-4)")
    rows = [[k, recall[f"@{k}"]["recall"], recall[f"@{k}"]["hit"]] for k in KS] + [["all facts (ceiling)", result["ceiling_recall"], None]]
    print(table(rows, ["k", "evidence recall@k", "hit@k"], ".3f"))
    rows = [[f"{cat} {result['category_names'][cat]}", v["questions"], *(v[f"recall@{k}"] for k in KS)] for cat, v in by_category.items()]
    print(table(rows, ["category", "questions", *(f"recall@{k}" for k in KS)], ".3f"))
    print(f"\nexact CPU search, {latency['user_facts']}-fact user ({latency['index_facts_total']} facts in the index), {len(queries)} queries:")
    rows = [[t, k, latency[f"threads{t}_k{k}"]["p50_ms"], latency[f"threads{t}_k{k}"]["p95_ms"]] for t in (1, 2) for k in (10, 50)]
    print(table(rows, ["torch threads", "k", "p50 ms", "p95 ms"], ".3f"))
    v = latency["query_embedding_cpu"]
    print(f"(query embedding, {model_name} on CPU: p50 {v['p50_ms']:.1f} ms)")
    print_tables(retrievers)
    print(f"\nCPU cost at k = 50, torch on 1 thread (p50 / p95 ms):")
    for n in (300, 2000):
        row = hybrid_latency[f"user_{n}_facts"]
        print(f"  {n}-fact user: " + ", ".join(f"{name} {v['p50_ms']:.3f} / {v['p95_ms']:.3f}" for name, v in row.items() if isinstance(v, dict)))
    print("\nsecond stages over the first stage's top 50, recall@10 (multi-hop): first half / second half / all")
    for name, row in alternatives.items():
        cells = [f"{row[h]['recall@10']:.3f} ({row[h]['by_category']['1']['recall@10']:.3f})" for h in halves(len(convs))]
        print(f"  {name}: " + " / ".join(cells[1:] + cells[:1]) + (f"  [chosen: {row['chosen_on_first_half']}]" if "chosen_on_first_half" in row else ""))
    print("\nupper bound, not a retriever (reads the answers): recall@10 with the first stage's top-n perfectly re-ordered")
    for name, row in oracle.items():
        print(f"  {name}: {row}")
    if tuning:
        print("\ntuning grid (conversations 0-3), best recall@10 first:")
        for row in sorted(tuning, key=lambda r: -r["recall@10"])[:10]:
            print(f"  {row['recall@10']:.3f} (multi-hop {row['multi_hop_recall@10']:.3f}) {row['settings']}")
    print(f"data quirks: {quirks}")


if __name__ == "__main__":
    main()
