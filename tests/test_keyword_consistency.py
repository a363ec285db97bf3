"""The keyword index stays in step with the vector index (memory.retrieval.Retriever beside an
ExactIndex, written together as MemoryShard writes them) under tests/test_vector_index.py's random
workload of adds, replacements, removals and user clears: the same facts, never a removed, moved
or foreign one in a keyword or hybrid search."""

from __future__ import annotations

import numpy as np
import pytest

from memory.index import ExactIndex
from tests.test_vector_index import DIM, check_against_model, random_workload


WORDS = ("violin", "lisbon", "chess", "camping", "pottery", "sunrise", "beach", "dance")


def text_of(v: np.ndarray) -> str:
    return f"fact about {WORDS[int(np.argmax(v[: len(WORDS)]))]}"


class IndexWithRetriever:
    """An ExactIndex and a memory.retrieval.Retriever (its keyword index) written together, as
    MemoryShard does: add = track_version, remove = forget, clear_user = delete_all."""

    def __init__(self) -> None:
        from memory.retrieval import Retriever
        from memory.settings import RetrievalSettings

        self.index = ExactIndex(DIM, initial_capacity=4)
        self.retriever = Retriever(RetrievalSettings(expand="session"), self.index)

    def add(self, ids, users, vecs) -> None:
        from memory.fact_store import FactRecord

        self.index.add(ids, users, vecs)
        last = {f: (u, v) for f, u, v in zip(ids, users, vecs)}  # a duplicate id keeps the last row
        self.retriever.track(
            FactRecord(fact_id=f, user_id=u, text=text_of(v), session_time="8 May 2023", created_at=0.0, updated_at=0.0)
            for f, (u, v) in last.items()
        )

    def remove(self, ids) -> int:
        for f in ids:
            self.retriever.forget(f)
        return self.index.remove(ids)

    def clear_user(self, user) -> int:
        self.retriever.clear_user(user)
        return self.index.clear_user(user)


@pytest.mark.parametrize("seed", [0, 1])
def test_keyword_index_stays_in_step_with_the_vector_index(seed: int) -> None:
    both = IndexWithRetriever()
    store = random_workload(both, seed)
    check_against_model(both.index, store, seed)
    keyword = both.retriever.keyword
    assert len(keyword) == len(both.index) == len(store)
    q = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    for u in [f"u{i}" for i in range(4)]:
        mine = {f for f, (o, _) in store.items() if o == u}
        assert set(keyword.fact_ids(u)) == mine
        for word in WORDS[:3]:
            want = {f for f in mine if text_of(store[f][1]).endswith(word)}
            assert {h.fact_id for h in keyword.search(u, word, 10_000)} == want
            hybrid = {h.fact_id for h in both.retriever.search(u, f"{word} in May", q, 50)}
            assert hybrid <= mine and len(hybrid) == min(50, len(mine))  # never a removed, moved or foreign fact
