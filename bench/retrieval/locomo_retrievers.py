"""LoCoMo evidence recall per retriever through the shard's own retrieval code
(memory.retrieval.Retriever over an ExactIndex), the CPU cost of a hybrid search, and the second
stages tried over the first stage's top 50; bench/retrieval/locomo_recall.py calls it. Protocol:
docs/bench.md, docs/retrieval.md."""

from __future__ import annotations

import itertools
import re
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from bench.kit.results import percentiles, progress

from memory.fact_store import FactRecord
from memory.index import ExactIndex
from memory.index.keyword import KeywordIndex
from memory.retrieval import Retriever, RetrievalSettings, is_time_question, turn_diverse

KS = (5, 10, 20, 50)



def halves(n: int) -> dict[str, range]:
    """all, the first half (where settings are chosen) and the second half (held out) of n conversations."""
    h = n // 2
    return {"all": range(0, n), f"conversations_0_{h - 1}": range(0, h), f"conversations_{h}_{n - 1}": range(h, n)}


CATEGORIES = {"1": "multi-hop", "2": "temporal", "3": "open-domain", "4": "single-hop"}
_PLAIN = {"session_dates": False, "turn_context": False, "time_keyword_boost": 1.0, "expand": "none", "rerank": "none"}
RETRIEVERS: dict[str, dict[str, Any]] = {
    "dense": {"retriever": "dense", "rerank": "none"},
    "keyword": {"retriever": "keyword", **_PLAIN},
    "hybrid": {"retriever": "hybrid", **_PLAIN},
    "+time": {"retriever": "hybrid", "turn_context": False, "expand": "none", "rerank": "none"},
    "+turn context": {"retriever": "hybrid", "expand": "none", "rerank": "none"},
    "+expansion": {"retriever": "hybrid", "expand": "session", "expand_top": 1, "expand_per_hit": 2, "rerank": "none"},  # the best expansion on 0-3
    "+turn-diverse rerank": {"retriever": "hybrid", "expand": "none", "rerank": "turn_diverse"},
    "dense +turn-diverse rerank": {"retriever": "dense", "rerank": "turn_diverse"},
    "shipped default": {},
}


def build(convs: list[dict], fact_vecs: np.ndarray, settings: RetrievalSettings) -> Retriever:
    """One ExactIndex and one Retriever holding every conversation (one user each)."""
    index = ExactIndex(fact_vecs.shape[1], "cpu")
    facts = [f for c in convs for f in c["facts"]]
    index.add([f["id"] for f in facts], [c["id"] for c in convs for _ in c["facts"]], fact_vecs)
    turns = {c["id"]: c["turns"] for c in convs}
    retriever = Retriever(settings, index, context_of=lambda user, ids: [turns[user].get(i) for i in ids])
    now = time.time()
    retriever.track(
        FactRecord(fact_id=f["id"], user_id=c["id"], text=f["text"], source_id=f["source_id"], session_time=f["session_time"],
                   created_at=now, updated_at=now)
        for c in convs for f in c["facts"]
    )  # fmt: skip
    retriever.refresh()
    return retriever


def coverage(src: dict[str, set[str]], ids: Sequence[str], evidence: set[str], ks: Sequence[int] = KS) -> list[float]:
    """Recall at each k: the share of the evidence turns that the top-k facts (`ids`) cite."""
    return [len(evidence & set().union(*(src[f] for f in ids[:k]))) / len(evidence) for k in ks]


def recall_rows(
    convs: list[dict], q_vecs: np.ndarray, retriever: Retriever, subset: Sequence[int], desc: str | None = None
) -> list[tuple[int, list[float]]]:
    """(category, recall at each of KS) per question of the conversations in `subset`."""
    offsets = np.cumsum([0] + [len(c["questions"]) for c in convs])
    rows = []
    todo = [(ci, qi) for ci in subset for qi in range(len(convs[ci]["questions"]))]
    for ci, qi in progress(todo, desc=desc, unit="q", disable=desc is None, leave=False):
        conv, q = convs[ci], convs[ci]["questions"][qi]
        src = {f["id"]: f["src"] for f in conv["facts"]}
        hits = retriever.search(conv["id"], q["text"], q_vecs[offsets[ci] + qi], max(KS))
        rows.append((q["category"], coverage(src, [h.fact_id for h in hits], q["evidence"])))
    return rows


def summarise(rows: list[tuple[int, list[float]]]) -> dict[str, Any]:
    a = np.array([r for _, r in rows])
    out: dict[str, Any] = {"questions": len(rows)}
    out.update({f"recall@{k}": round(float(a[:, i].mean()), 4) for i, k in enumerate(KS)})
    out.update({f"hit@{k}": round(float((a[:, i] > 0).mean()), 4) for i, k in enumerate(KS)})
    by_cat: dict[str, Any] = {}
    for cat in sorted({c for c, _ in rows}):
        sel = np.array([r for c, r in rows if c == cat])
        by_cat[str(cat)] = {"questions": len(sel), **{f"recall@{k}": round(float(sel[:, i].mean()), 4) for i, k in enumerate(KS)}}
    out["by_category"] = by_cat
    return out


def evaluate_retrievers(convs: list[dict], fact_vecs: np.ndarray, q_vecs: np.ndarray) -> dict[str, Any]:
    """RETRIEVERS on all eight conversations and on each half."""
    out: dict[str, Any] = {}
    for name, fields in RETRIEVERS.items():
        settings = RetrievalSettings(**fields)
        retriever = build(convs, fact_vecs, settings)
        rows = recall_rows(convs, q_vecs, retriever, range(len(convs)), desc=f"recall: {name}")
        per_conv = {ci: [] for ci in range(len(convs))}
        flat = iter(rows)
        for ci in range(len(convs)):
            per_conv[ci] = [next(flat) for _ in convs[ci]["questions"]]
        out[name] = {"settings": settings.model_dump()}
        for subset, idx in halves(len(convs)).items():
            sel = [r for ci in idx for r in per_conv[ci]]
            if sel:
                out[name][subset] = summarise(sel)
    return out


def oracle_bounds(convs: list[dict], fact_vecs: np.ndarray, q_vecs: np.ndarray, pools: Sequence[int] = (10, 20, 50)) -> dict[str, Any]:
    """Not a retriever (it reads the answers): recall@10 if the top-`pool` facts of the shipped
    first stage (RetrievalSettings() as the service runs it, 50 candidates per list, no second
    stage) were perfectly re-ordered (those citing an evidence turn first). What any second stage
    over that candidate list could reach at k = 10; pool 10 = the first stage's own top 10."""
    settings = RetrievalSettings(rerank="none")
    assert max(pools) <= settings.candidates, "a pool deeper than the service's candidate list"
    retriever = build(convs, fact_vecs, settings)
    offsets = np.cumsum([0] + [len(c["questions"]) for c in convs])
    rows: dict[int, list[tuple[int, list[float]]]] = {p: [] for p in pools}
    for ci, conv in enumerate(convs):
        src = {f["id"]: f["src"] for f in conv["facts"]}
        for qi, q in enumerate(conv["questions"]):
            ids = [h.fact_id for h in retriever.search(conv["id"], q["text"], q_vecs[offsets[ci] + qi], max(pools))]
            for p in pools:
                pool = ids[:p]
                ordered = [f for f in pool if src[f] & q["evidence"]] + [f for f in pool if not src[f] & q["evidence"]]
                rows[p].append((q["category"], coverage(src, ordered, q["evidence"], (10,)) * len(KS)))
    out = {}
    for p in pools:
        summary = summarise(rows[p])
        out[f"top_{p}"] = {"recall@10": summary["recall@10"], **{f"{CATEGORIES[c]}_recall@10": v["recall@10"] for c, v in summary["by_category"].items()}}
    return out


def tune(convs: list[dict], fact_vecs: np.ndarray, q_vecs: np.ndarray) -> list[dict[str, Any]]:
    """The grid the shipped settings were chosen from: recall@10 on the first half of the conversations only."""
    grid: list[dict[str, Any]] = []
    for rrf_k, weight in itertools.product((5, 10, 20, 60), (0.5, 0.75, 1.0, 1.5)):
        grid.append({"rrf_k": rrf_k, "keyword_weight": weight, "expand": "none", "time_keyword_boost": 1.0})
    for boost in (1.5, 2.0, 3.0):
        grid.append({"time_keyword_boost": boost, "expand": "none"})
    for mode, top, per in itertools.product(("turn", "session"), (1, 2, 3), (1, 2)):
        grid.append({"expand": mode, "expand_top": top, "expand_per_hit": per, "rerank": "none"})
    for rerank in ("none", "turn_diverse"):
        grid.append({"rerank": rerank})
    out = []
    first_half = range(len(convs) // 2)
    for fields in progress(grid, desc="tuning on the first half", unit="setting"):
        summary = summarise(recall_rows(convs, q_vecs, build(convs, fact_vecs, RetrievalSettings(**fields)), first_half))
        out.append({"settings": fields, "recall@10": summary["recall@10"], "multi_hop_recall@10": summary["by_category"]["1"]["recall@10"]})
    return out


def search_latency(convs: list[dict], fact_vecs: np.ndarray, q_vecs: np.ndarray, queries: int, warmup: int) -> dict[str, Any]:
    """CPU cost at k = 50 (torch on one thread) for a 300- and a 2,000-fact user: the dense search
    alone, the keyword search alone, the first stage (dense + keyword + fusion), the shipped search
    (first and second stage), the second stage alone (turn_diverse over a first-stage top 50), and
    the keyword index's rebuild after a write."""
    facts = [f for c in convs for f in c["facts"]]
    texts = [q["text"] for c in convs for q in c["questions"]]
    threads0 = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"k": 50, "torch_threads": 1, "queries": queries, "warmup": warmup}
    try:
        for n in (300, 2000):
            turns: dict[str, str] = {}
            for c in convs:  # turn ids repeat across conversations: the first one's text stands in
                for turn_id, text in c["turns"].items():
                    turns.setdefault(turn_id, text)
            user = [{"id": "latency-user", "facts": facts[:n], "turns": turns, "questions": []}]
            retriever = build(user, fact_vecs[:n], RetrievalSettings())
            first_stage = build(user, fact_vecs[:n], RetrievalSettings(rerank="none"))
            keyword: KeywordIndex = retriever.keyword
            qs = [(texts[i % len(texts)], q_vecs[i % len(texts)]) for i in range(queries)]
            top50 = {t: [h.fact_id for h in first_stage.search("latency-user", t, v, 50)] for t, v in qs[:warmup]}
            source = {f["id"]: f["source_id"] for f in facts[:n]}
            timed: dict[str, list[float]] = defaultdict(list)
            calls = {
                "dense_search": lambda t, v: retriever.index.search("latency-user", v, 50),
                "keyword_search": lambda t, v: keyword.search("latency-user", t, 50),
                "first_stage_search": lambda t, v: first_stage.search("latency-user", t, v, 50),
                "hybrid_search": lambda t, v: retriever.search("latency-user", t, v, 50),  # the shipped search, second stage included
                "second_stage_alone": lambda t, v: turn_diverse(top50[t], source.get),  # on a top 50 computed beforehand
            }
            qs_of = {"second_stage_alone": [(t, v) for t, v in qs[:warmup]] * (queries // max(1, warmup))}
            for name, call in calls.items():
                for t, v in qs[:warmup]:
                    call(t, v)
                for t, v in qs_of.get(name, qs):
                    start = time.perf_counter()
                    call(t, v)
                    timed[name].append(time.perf_counter() - start)
            rebuild = []
            for i in range(20):
                f = facts[i]
                keyword.add([f["id"]], ["latency-user"], [f["text"]])
                start = time.perf_counter()
                keyword.refresh()
                rebuild.append(time.perf_counter() - start)
            row = {name: _ms(ts) for name, ts in timed.items()}
            row["hybrid_minus_dense_p50_ms"] = round(row["hybrid_search"]["p50_ms"] - row["dense_search"]["p50_ms"], 4)
            row["second_stage_p50_ms"] = round(row["hybrid_search"]["p50_ms"] - row["first_stage_search"]["p50_ms"], 4)
            row["keyword_rebuild"] = _ms(rebuild)
            out[f"user_{n}_facts"] = row
    finally:
        torch.set_num_threads(threads0)
    return out


def _ms(ts: list[float]) -> dict[str, float]:
    return percentiles(ts, (50, 95), 1e3, 4, "_ms", n=True)


def print_tables(results: dict[str, Any]) -> None:
    for subset in [name for name in next(iter(results.values())) if name != "settings"]:
        print(f"\nevidence recall, {subset.replace('_', ' ')}")
        print("| retriever | " + " | ".join(f"@{k}" for k in KS) + " | " + " | ".join(f"{n} @10" for n in CATEGORIES.values()) + " |")
        print("|---|" + "---|" * (len(KS) + len(CATEGORIES)))
        for name, res in results.items():
            if subset not in res:
                continue
            r = res[subset]
            cats = " | ".join(f"{r['by_category'][c]['recall@10']:.3f}" if c in r["by_category"] else "-" for c in CATEGORIES)
            print(f"| {name} | " + " | ".join(f"{r[f'recall@{k}']:.3f}" for k in KS) + f" | {cats} |")


# ------------------------------------------------------------------------------ second stages
# tried over the shipped first stage's top 50 (docs/bench.md: the alternatives and how they are fitted)
_NAME = re.compile(r"\b[A-Z][a-z]+")
_WORDS = re.compile(r"[a-z]+")
Ranker = Callable[[dict[str, Any]], list[str]]


def candidates(convs: list[dict], fact_vecs: np.ndarray, q_vecs: np.ndarray, depth: int = 50) -> list[dict[str, Any]]:
    """Per question: the first stage's top `depth` ids with their dense cosines and BM25 scores."""
    retriever = build(convs, fact_vecs, RetrievalSettings(rerank="none"))
    offsets = np.cumsum([0] + [len(c["questions"]) for c in convs])
    out = []
    for ci, conv in enumerate(convs):
        facts = {f["id"]: f for f in conv["facts"]}
        for qi, q in enumerate(conv["questions"]):
            hits = retriever.search(conv["id"], q["text"], q_vecs[offsets[ci] + qi], depth)
            keyword = {h.fact_id: h.score for h in retriever.keyword.search(conv["id"], q["text"], depth)}
            out.append({"ci": ci, "q": q, "facts": facts, "ids": [h.fact_id for h in hits], "cos": [h.score for h in hits], "kw": keyword})
    return out


def _score(rows: list[dict[str, Any]], rank: Ranker, idx: Sequence[int]) -> dict[str, Any]:
    out = []
    for row in rows:
        if row["ci"] not in idx:
            continue
        src = {f: fact["src"] for f, fact in row["facts"].items()}
        out.append((row["q"]["category"], coverage(src, rank(row), row["q"]["evidence"])))
    return summarise(out)


def _turn(row: dict[str, Any]) -> Callable[[str], str | None]:
    return lambda f: row["facts"][f]["source_id"]


def entity_boost(w: float) -> Ranker:
    def rank(row: dict[str, Any]) -> list[str]:
        names = {n.lower() for n in _NAME.findall(row["q"]["text"])[1:]}
        score = []
        for r, f in enumerate(row["ids"]):
            words = set(_WORDS.findall(row["facts"][f]["text"].lower()))
            score.append(1 / (11 + r) + (w * 0.05 * len(names & words) / len(names) if names else 0.0))
        return [row["ids"][i] for i in np.argsort(-np.array(score), kind="stable")]

    return rank


def session_diversity(penalty: float) -> Ranker:
    def rank(row: dict[str, Any]) -> list[str]:
        left, taken, out = list(row["ids"]), {}, []
        base = {f: 1 / (11 + r) for r, f in enumerate(row["ids"])}
        session = {f: (row["facts"][f]["source_id"] or "").split(":")[0] for f in left}
        while left:
            best = max(left, key=lambda f: base[f] * penalty ** taken.get(session[f], 0))
            out.append(best)
            left.remove(best)
            taken[session[best]] = taken.get(session[best], 0) + 1
        return out

    return rank


def _features(row: dict[str, Any]) -> np.ndarray:
    q = row["q"]["text"]
    words, names, time_q = set(_WORDS.findall(q.lower())), {n.lower() for n in _NAME.findall(q)[1:]}, float(is_time_question(q))
    kw_max = max(row["kw"].values(), default=0.0) or 1.0
    sessions: dict[str, int] = {}
    for f in row["ids"][:10]:
        s = (row["facts"][f]["source_id"] or "").split(":")[0]
        sessions[s] = sessions.get(s, 0) + 1
    seen: dict[str, int] = {}
    out = []
    for r, f in enumerate(row["ids"]):
        fact = row["facts"][f]
        turn = fact["source_id"] or ""
        fw = set(_WORDS.findall(fact["text"].lower()))
        out.append([r, row["cos"][r], row["kw"].get(f, 0.0) / kw_max, float(f in row["kw"]), len(names & fw) / max(1, len(names)),
                    len(words & fw) / max(1, len(words)), time_q, seen.get(turn, 0), sessions.get(turn.split(":")[0], 0),
                    len(fact["text"]), np.log1p(r)])  # fmt: skip
        seen[turn] = seen.get(turn, 0) + 1
    return np.array(out, dtype=np.float64)


def learned_gbm(rows: list[dict[str, Any]], train: Sequence[int]) -> Ranker:
    from sklearn.ensemble import HistGradientBoostingClassifier  # installed with sentence-transformers

    x = [(_features(r), [float(bool(r["facts"][f]["src"] & r["q"]["evidence"])) for f in r["ids"]]) for r in rows if r["ci"] in train]
    model = HistGradientBoostingClassifier(max_iter=200, learning_rate=0.05, max_leaf_nodes=15, random_state=0)
    model.fit(np.vstack([a for a, _ in x]), np.concatenate([b for _, b in x]))

    def rank(row: dict[str, Any]) -> list[str]:
        p = model.predict_proba(_features(row))[:, 1]
        return turn_diverse([row["ids"][i] for i in np.argsort(-p, kind="stable")], _turn(row))

    return rank


def second_stage_alternatives(convs: list[dict], fact_vecs: np.ndarray, q_vecs: np.ndarray) -> dict[str, Any]:
    """Every alternative on both halves; a setting is picked by recall@10 on the first half."""
    rows = candidates(convs, fact_vecs, q_vecs)
    parts = halves(len(convs))
    first = list(parts)[1]

    def report(rank: Ranker) -> dict[str, Any]:
        return {name: _score(rows, rank, idx) for name, idx in parts.items()}

    out: dict[str, Any] = {"first stage (no second stage)": report(lambda r: r["ids"]),
                           "turn_diverse (shipped)": report(lambda r: turn_diverse(r["ids"], _turn(r)))}  # fmt: skip
    for name, make, grid in (("entity_boost", entity_boost, (0.5, 1.0, 2.0)), ("session_diversity", session_diversity, (0.9, 0.8, 0.7))):
        tried = {p: _score(rows, make(p), parts[first])["recall@10"] for p in grid}
        best = max(tried, key=tried.__getitem__)
        out[name] = {"chosen_on_first_half": best, "first_half_recall@10_by_setting": tried, **report(make(best))}
    out["learned_gbm"] = report(learned_gbm(rows, parts[first]))
    return out
