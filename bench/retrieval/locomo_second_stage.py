"""Second stages tried over the shipped first stage's top 50 on LoCoMo (bench/retrieval/locomo_recall.py).
The alternatives and how they are fitted: docs/bench.md."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench.retrieval.locomo_retrievers import build, halves, summarise
from memory.retrieval import RetrievalSettings, is_time_question, turn_diverse

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
        order, facts, q = rank(row), row["facts"], row["q"]
        cov = [set().union(*(facts[f]["src"] for f in order[:k])) if order else set() for k in (5, 10, 20, 50)]
        out.append((q["category"], [len(q["evidence"] & c) / len(q["evidence"]) for c in cov]))
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
