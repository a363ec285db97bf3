"""Hybrid retrieval in the shard: dense vectors + per-user BM25, fused; session dates; expansion.

    Retriever          what MemoryShard searches through: keeps the keyword index in step with
                       the vector index (track / forget / clear_user) and answers search()
    rrf_fuse           weighted reciprocal-rank fusion of ranked hit lists (ties share a rank)
    expand             neighbours (same source turn / same session) of the strongest hits
    turn_diverse       the second stage: one fact per source turn first, then the repeats
    keyword_document   the text a fact is keyword-indexed under (fact, session date, source turn)
    is_time_question   "when ..."-like questions and questions naming a month or a year
    store_turn_texts   source turn texts from the FactStore (Redis), for keyword_document

A search (retriever "hybrid"): the dense index's top `candidates` for the query vector and the
keyword index's top `candidates` for the query text (memory.index.keyword: bm25s), fused with
rrf_fuse (weights dense_weight, keyword_weight; keyword_weight times time_keyword_boost for a time
question), then optionally expanded; then the second stage re-orders the first stage's top
`candidates` (rerank "turn_diverse": a fact whose source turn a better-ranked fact already
brings moves behind every fact of a new turn); then cut to k. A hit's score stays the dense cosine where the
dense search returned the fact, and is 0.0 for a fact only the keyword search found (so a
min-score filter such as reconciliation's never admits a fact on its keyword score).

Time: a fact's session date ("1:56 pm on 8 May, 2023", or ISO) is written into its keyword
document as "8 May 2023", so "what did she do in May 2023" matches the facts of that session.
Turn context: with `turn_context`, the text of the fact's source turn (the conversation turn it
was extracted from, stored by an add's commit_add) is part of its keyword document too: a question uses the
speaker's words, which the one-sentence fact may have paraphrased away.

Consistency: the keyword index holds exactly the facts the vector index holds (the shard calls
track on every add, update and read repair, forget on every delete, clear_user on delete_all), and
search drops any id the vector index does not hold for that user, so a deleted, superseded or
foreign fact is never returned. Measured: docs/retrieval.md, bench/retrieval/locomo_recall.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from memory.index.base import SearchHit
from memory.index.keyword import KeywordIndex
from memory.records import Turn
from memory.settings import RetrievalSettings

if TYPE_CHECKING:
    import numpy as np

    from memory.fact_store import FactRecord, FactStore
    from memory.index.base import VectorIndex

__all__ = [
    "Retriever",
    "expand",
    "is_time_question",
    "keyword_document",
    "rrf_fuse",
    "session_date_text",
    "store_turn_texts",
    "turn_diverse",
]

ContextOf = Callable[[str, Sequence[str]], Sequence[str | None]]
"""(user id, source turn ids) -> each turn's text, None where unknown."""


# ---------------------------------------------------------------------------- pure parts
_CLOCK = re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\s*(?:[ap]\.?m\.?)?\s*(?:on\s+)?", re.I)
_MONTHS = "january|february|march|april|may|june|july|august|september|october|november|december"
_TIME_Q = re.compile(
    rf"\b(when|what (?:year|month|day|date|time)|which (?:year|month|day|date)|how long|how many (?:years|months|weeks|days)"
    rf"|ago|since|(?:19|20)\d\d|{_MONTHS})\b",
    re.I,
)


def session_date_text(session_time: str | None) -> str:
    """'1:56 pm on 8 May, 2023' -> '8 May, 2023'; an ISO date or time -> '8 May 2023'; '' for None."""
    if not session_time:
        return ""
    try:
        when = datetime.fromisoformat(session_time.strip())
    except ValueError:
        return _CLOCK.sub("", session_time).strip()
    return f"{when.day} {when:%B %Y}"


def is_time_question(query: str) -> bool:
    """A question about time: when / what year / how long ..., or one naming a month or a year."""
    return _TIME_Q.search(query) is not None


def keyword_document(text: str, session_time: str | None = None, context: str | None = None) -> str:
    """The text a fact is keyword-indexed under: the fact, its session date, its source turn."""
    return " ".join(part for part in (text, session_date_text(session_time), context) if part)


def rrf_fuse(lists: Sequence[Sequence[SearchHit]], weights: Sequence[float], rrf_k: float) -> list[str]:
    """Weighted reciprocal-rank fusion: score(id) = sum over lists of w / (rrf_k + rank), where a
    hit's rank is 1 + the number of hits of its list with a strictly higher score, so hits that
    tie share the best rank of their tie (a tie says nothing about order: 30 facts that all match
    a query's words equally must not be ranked 1..30 by insertion order). Each list is best first.
    Best first; ties of the fused score go to the id that appears earliest in the earliest list."""
    score: dict[str, float] = {}
    first: dict[str, tuple[int, int]] = {}
    for li, (hits, weight) in enumerate(zip(lists, weights)):
        rank, previous = 0, None
        for position, hit in enumerate(hits, 1):
            if previous is None or hit.score != previous:
                rank, previous = position, hit.score
            score[hit.fact_id] = score.get(hit.fact_id, 0.0) + weight / (rrf_k + rank)
            first.setdefault(hit.fact_id, (li, position))
    return sorted(score, key=lambda i: (-score[i], first[i]))


def expand(ranked: Sequence[str], group_of: Callable[[str], Sequence[str]], top: int, per_hit: int, k: int) -> list[str]:
    """`ranked` with up to `per_hit` members of each of the `top` first hits' groups (group_of: the
    hit's neighbours, best first, the hit itself left out) placed right after that hit; cut to k."""
    out: list[str] = []
    seen: set[str] = set()
    for rank, fact_id in enumerate(ranked):
        if len(out) >= k:
            break
        if fact_id in seen:
            continue
        out.append(fact_id)
        seen.add(fact_id)
        if rank < top:
            added = 0
            for other in group_of(fact_id):
                if added >= per_hit:
                    break
                if other not in seen:
                    out.append(other)
                    seen.add(other)
                    added += 1
    return out[:k]


def turn_diverse(ranked: Sequence[str], turn_of: Callable[[str], str | None]) -> list[str]:
    """`ranked` with every fact whose source turn an earlier fact already has moved behind the
    facts of new turns (each group keeps its order). Facts of one turn say one thing: the second
    brings no turn the first did not, while a fact of another turn may (LoCoMo: a question's
    evidence spans 1.4 turns on average, 3 for multi-hop questions). A fact without a turn is new."""
    first: list[str] = []
    repeats: list[str] = []
    seen: set[str] = set()
    for fact_id in ranked:
        turn = turn_of(fact_id)
        if turn is None or turn not in seen:
            first.append(fact_id)
            if turn is not None:
                seen.add(turn)
        else:
            repeats.append(fact_id)
    return first + repeats


def store_turn_texts(store: FactStore) -> ContextOf:
    """(user, turn ids) -> the turns' texts from Redis (one HMGET); Nones when Redis fails."""
    def texts(user_id: str, turn_ids: Sequence[str]) -> list[str | None]:
        if not turn_ids:
            return []
        try:
            raw = store.r.hmget(store.keys.user(user_id, "turns"), list(turn_ids))
        except Exception:  # noqa: BLE001 - the keyword document goes without its turn
            return [None] * len(turn_ids)
        return [Turn.model_validate_json(x).text if x is not None else None for x in raw]

    return texts


# ---------------------------------------------------------------------------- the retriever
class Retriever:
    """A shard's retrieval over its vector index and a keyword index kept in step with it."""

    def __init__(self, settings: RetrievalSettings, index: VectorIndex, context_of: ContextOf | None = None) -> None:
        self.settings = settings
        self.index = index
        self.context_of = context_of if settings.turn_context else None
        self.keyword: Any = None  # memory.index.keyword.KeywordIndex (bm25s) unless dense only
        if settings.retriever != "dense":
            self.keyword = KeywordIndex(stemmer=settings.stemmer)
        # fact id -> (user id, turn group key, session group key), for expansion
        self._meta: dict[str, tuple[str, str | None, str | None]] = {}
        self._turn: dict[str, tuple[str, str]] = {}  # fact id -> (user id, source turn id), for the second stage
        self._groups: dict[tuple[str, str], dict[str, None]] = {}  # (user, key) -> fact ids, ordered

    # ------------------------------------------------------------------ writes
    def track(self, records: Iterable[FactRecord]) -> None:
        """Index these versions of facts (new facts or new versions; the vector index has them)."""
        records = list(records)
        if self.settings.rerank == "turn_diverse":
            for r in records:
                if r.source_id:
                    self._turn[r.fact_id] = (r.user_id, r.source_id)
                else:
                    self._turn.pop(r.fact_id, None)
        if self.keyword is not None and records:
            contexts: list[str | None] = [None] * len(records)
            if self.context_of is not None:
                by_user: dict[str, list[int]] = {}
                for i, r in enumerate(records):
                    if r.source_id:
                        by_user.setdefault(r.user_id, []).append(i)
                for user_id, idx in by_user.items():
                    for i, text in zip(idx, self.context_of(user_id, [records[i].source_id for i in idx])):  # type: ignore[misc]
                        contexts[i] = text
            dates = [r.session_time if self.settings.session_dates else None for r in records]
            docs = [keyword_document(r.text, d, c) for r, d, c in zip(records, dates, contexts)]
            self.keyword.add([r.fact_id for r in records], [r.user_id for r in records], docs)
        if self.settings.expand != "none":
            for r in records:
                self._ungroup(r.fact_id)
                turn = f"t:{r.source_id}" if r.source_id else None
                session = f"s:{r.session_time}" if r.session_time else None
                self._meta[r.fact_id] = (r.user_id, turn, session)
                for key in (turn, session):
                    if key is not None:
                        self._groups.setdefault((r.user_id, key), {})[r.fact_id] = None

    def forget(self, fact_id: str) -> None:
        if self.keyword is not None:
            self.keyword.remove([fact_id])
        self._ungroup(fact_id)
        self._turn.pop(fact_id, None)

    def clear_user(self, user_id: str) -> None:
        if self.keyword is not None:
            self.keyword.clear_user(user_id)
        for fact_id in [f for f, (user, _) in self._turn.items() if user == user_id]:
            del self._turn[fact_id]
        for fact_id in [f for f, meta in self._meta.items() if meta[0] == user_id]:
            self._ungroup(fact_id)

    def _ungroup(self, fact_id: str) -> None:
        meta = self._meta.pop(fact_id, None)
        if meta is None:
            return
        for key in meta[1:]:
            if key is not None and (members := self._groups.get((meta[0], key))) is not None:
                members.pop(fact_id, None)
                if not members:
                    del self._groups[(meta[0], key)]

    def refresh(self) -> int:
        """Rebuild dirty per-user keyword indexes now (call it off the chat path)."""
        return self.keyword.refresh() if self.keyword is not None else 0

    # ------------------------------------------------------------------ reads
    def search(self, user_id: str, query: str, vector: np.ndarray, k: int) -> list[SearchHit]:
        """The user's top-k facts for the query (text and its embedding), best first."""
        s = self.settings
        if k <= 0:
            return []
        depth = max(k, s.candidates)
        if s.retriever == "dense":
            if s.rerank == "none":
                return self.index.search(user_id, vector, k)[0]
            dense_hits = self.index.search(user_id, vector, depth)[0]
            return self._second_stage([h.fact_id for h in dense_hits], {h.fact_id: h.score for h in dense_hits}, k)
        dense = self.index.search(user_id, vector, depth)[0] if s.retriever == "hybrid" else []
        keyword = self.keyword.search(user_id, query, depth) if query else []
        cosine = {hit.fact_id: hit.score for hit in dense}
        boost = s.time_keyword_boost if s.time_keyword_boost != 1.0 and is_time_question(query) else 1.0
        ranked = rrf_fuse([dense, keyword], [s.dense_weight, s.keyword_weight * boost], s.rrf_k)
        if s.expand != "none" and s.expand_top and s.expand_per_hit:
            position = {fact_id: i for i, fact_id in enumerate(ranked)}
            ranked = expand(ranked, lambda f: self._neighbours(f, position), s.expand_top, s.expand_per_hit, len(ranked) + k)
        index = self.index
        kept: list[str] = []
        wanted = depth if s.rerank != "none" else k
        for fact_id in ranked:
            if fact_id in cosine or index.user_of(fact_id) == user_id:  # never a fact the vector index lacks
                kept.append(fact_id)
                if len(kept) >= wanted:
                    break
        return self._second_stage(kept, cosine, k)

    def _second_stage(self, ranked: list[str], cosine: dict[str, float], k: int) -> list[SearchHit]:
        """The first stage's top `candidates` (`ranked`, the user's facts only) re-ordered by the
        rerank setting, cut to k; a hit scores its dense cosine (0.0 when only keywords found it)."""
        if self.settings.rerank == "turn_diverse":
            turns = self._turn
            ranked = turn_diverse(ranked, lambda f: turns[f][1] if f in turns else None)
        return [SearchHit(fact_id, cosine.get(fact_id, 0.0)) for fact_id in ranked[:k]]

    def _neighbours(self, fact_id: str, position: dict[str, int]) -> list[str]:
        """Other facts of the hit's source turn (expand turn) or session (expand session): those
        among the fused candidates first, by rank; then the rest, most recently added first."""
        meta = self._meta.get(fact_id)
        if meta is None:
            return []
        key = meta[1] if self.settings.expand == "turn" else meta[2]
        members = [f for f in self._groups.get((meta[0], key), ()) if f != fact_id] if key else []
        far = len(position)
        order = {f: (position.get(f, far), -i) for i, f in enumerate(members)}
        return sorted(members, key=order.__getitem__)

    def stats(self) -> dict[str, Any]:
        kw = self.keyword
        return {
            "retriever": self.settings.retriever,
            "keyword_facts": 0 if kw is None else len(kw),
            "keyword_users_dirty": 0 if kw is None else kw.dirty_users(),
            "keyword_rebuilds_total": 0 if kw is None else kw.rebuilds,
        }
