"""memory.index.keyword (per-user BM25, bm25s) and memory.retrieval (fusion, time, expansion, and
the Retriever kept in step with a vector index). CPU only, no Redis, no engine."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from memory.fact_store import FactRecord
from memory.index import ExactIndex, SearchHit
from memory.index.keyword import KeywordIndex, Tokenizer
from memory.retrieval import (
    RetrievalSettings,
    Retriever,
    expand,
    is_time_question,
    keyword_document,
    rrf_fuse,
    session_date_text,
)
from memory.settings import MemorySettings

WORDS = "violin lisbon peanuts chess camping pottery painting sunrise beach dance studio store".split()


# ----------------------------------------------------------------------------- KeywordIndex
def test_keyword_search_scores_only_the_users_matching_documents() -> None:
    idx = KeywordIndex()
    idx.add(["a", "b", "c"], ["u", "u", "v"], ["Alice plays the violin.", "Alice went camping.", "Alice plays the violin."])
    assert [h.fact_id for h in idx.search("u", "Which violin do I play?", 10)] == ["a"]
    assert [h.fact_id for h in idx.search("v", "violin", 10)] == ["c"]  # the identical text of another user: its own
    assert idx.search("u", "the and of", 10) == []  # stop words only
    assert idx.search("u", "unknown words", 10) == [] and idx.search("nobody", "violin", 10) == []
    assert idx.search("u", "violin", 0) == []
    assert [h.fact_id for h in idx.search("u", "camps", 10)] == ["b"]  # stemmed: camps ~ camping
    hits = idx.search("u", "Alice", 10)
    assert {h.fact_id for h in hits} == {"a", "b"} and all(isinstance(h, SearchHit) and h.score > 0 for h in hits)


def test_keyword_replace_move_remove_and_clear_user() -> None:
    idx = KeywordIndex()
    idx.add(["a", "b"], ["u", "u"], ["Alice lives in Lisbon.", "Alice likes chess."])
    idx.add(["a"], ["u"], ["Alice moved to Oslo."])  # an update: the old text is gone
    assert idx.search("u", "Lisbon", 10) == [] and [h.fact_id for h in idx.search("u", "Oslo", 10)] == ["a"]
    idx.add(["b"], ["w"], ["Bob likes chess."])  # moved to another user
    assert idx.search("u", "chess", 10) == [] and [h.fact_id for h in idx.search("w", "chess", 10)] == ["b"]
    assert idx.user_of("b") == "w" and idx.count("u") == 1 and len(idx) == 2
    assert idx.remove(["a", "never-added"]) == 1 and "a" not in idx and idx.search("u", "Oslo", 10) == []
    assert idx.clear_user("w") == 1 and len(idx) == 0 and idx.fact_ids("w") == []
    assert idx.clear_user("w") == 0


def test_keyword_rebuilds_lazily_once_per_write_burst() -> None:
    idx = KeywordIndex()
    idx.add([f"f{i}" for i in range(50)], ["u"] * 50, [f"fact {i} about {WORDS[i % len(WORDS)]}" for i in range(50)])
    assert idx.dirty_users() == 1 and idx.rebuilds == 0
    assert idx.refresh() == 1 and idx.dirty_users() == 0
    idx.search("u", "violin", 5)
    idx.search("u", "chess", 5)
    assert idx.rebuilds == 1  # searches reuse the built index
    idx.add(["x"], ["u"], ["violin again"])
    assert [h.fact_id for h in idx.search("u", "violin again", 1)] == ["x"] and idx.rebuilds == 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_keyword_random_workload_matches_a_dict_model(seed: int) -> None:
    rng = np.random.default_rng(seed)
    idx, model = KeywordIndex(), {}  # fact id -> (user, text)
    for step in range(60):
        op = rng.random()
        if op < 0.6 or not model:
            n = int(rng.integers(1, 20))
            ids = [f"f{int(x)}" for x in rng.integers(0, 120, n)]  # collisions: replacements and moves
            users = [f"u{int(x)}" for x in rng.integers(0, 3, n)]
            texts = [" ".join(rng.choice(WORDS, 3)) for _ in ids]
            idx.add(ids, users, texts)
            model.update({f: (u, t) for f, u, t in zip(ids, users, texts)})
        elif op < 0.9:
            gone = [str(f) for f in rng.choice(list(model), size=min(len(model), 5), replace=False)]
            assert idx.remove(gone + ["never"]) == len(gone)
            for f in gone:
                del model[f]
        else:
            u = f"u{int(rng.integers(0, 3))}"
            assert idx.clear_user(u) == sum(owner == u for owner, _ in model.values())
            model = {f: v for f, v in model.items() if v[0] != u}
        if step % 7 == 0:
            for u in ("u0", "u1", "u2"):
                assert sorted(idx.fact_ids(u)) == sorted(f for f, (o, _) in model.items() if o == u)
                for word in WORDS[:4]:
                    got = {h.fact_id for h in idx.search(u, word, 1000)}
                    assert got == {f for f, (o, t) in model.items() if o == u and word in t.split()}
    assert len(idx) == len(model)


def test_the_keyword_index_leaves_numba_unloaded() -> None:
    """bm25s would import numba (llvmlite), which breaks building a vLLM engine later in the same process."""
    code = "import sys; from memory.index.keyword import KeywordIndex as K; k = K(); k.add(['a'], ['u'], ['x y']); k.search('u', 'x', 1); assert 'llvmlite' not in sys.modules and 'numba' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_tokenizer_stems_and_drops_stop_words() -> None:
    assert Tokenizer()("The dogs are running in the park") == ["dog", "run", "park"]
    assert Tokenizer(stemmer=None)("The dogs") == ["dogs"]


# ----------------------------------------------------------------------------- pure parts
def _ranked(*ids: str) -> list[SearchHit]:
    """Hits best first with distinct, falling scores."""
    return [SearchHit(fact_id, 1.0 - i / 100) for i, fact_id in enumerate(ids)]


def test_rrf_fuse_weights_and_ties() -> None:
    assert rrf_fuse([_ranked("a", "b", "c"), _ranked("c", "b")], [1.0, 1.0], 10) == ["c", "b", "a"]  # c: 1/13+1/11 > b: 1/12+1/12
    assert rrf_fuse([_ranked("a", "b"), _ranked("b", "a")], [1.0, 1.0], 10) == ["a", "b"]  # a tie: the first list's order
    assert rrf_fuse([_ranked("a", "b"), _ranked("b", "a")], [1.0, 2.0], 10) == ["b", "a"]
    assert rrf_fuse([_ranked("a"), []], [1.0, 1.0], 10) == ["a"] and rrf_fuse([[], []], [1, 1], 10) == []
    assert rrf_fuse([_ranked("a", "b"), _ranked("b")], [1.0, 0.0], 10) == ["a", "b"]  # weight 0: that list does not count


def test_rrf_fuse_gives_tied_scores_one_rank() -> None:
    """Thirty facts that match a query's words equally carry no keyword order: the dense order
    decides, whatever order the keyword index lists the tie in."""
    dense = _ranked("f5", "f1", "f0", "f2")
    tied = [SearchHit(f, 3.0) for f in ("f0", "f1", "f2", "f5")]
    assert rrf_fuse([dense, tied], [1.0, 1.0], 10) == ["f5", "f1", "f0", "f2"]
    # a strictly better keyword score still counts, and ranks after a tie skip its members
    keyword = [SearchHit("f2", 5.0), SearchHit("f0", 3.0), SearchHit("f1", 3.0), SearchHit("f5", 1.0)]
    # f2: 1/14 + 1/11; f1: 1/12 + 1/12; f5: 1/11 + 1/14 (rank 4, after the tie of two at rank 2)
    assert rrf_fuse([dense, keyword], [1.0, 1.0], 10) == ["f1", "f5", "f2", "f0"]


def test_expand_places_neighbours_after_the_strong_hits_within_k() -> None:
    groups = {"a": ["x", "y"], "b": ["z"], "c": ["w"]}
    ranked = ["a", "b", "c", "d"]
    assert expand(ranked, lambda f: groups.get(f, []), top=2, per_hit=1, k=10) == ["a", "x", "b", "z", "c", "d"]
    assert expand(ranked, lambda f: groups.get(f, []), top=1, per_hit=2, k=3) == ["a", "x", "y"]
    assert expand(["a", "x", "b"], lambda f: groups.get(f, []), top=3, per_hit=1, k=10) == ["a", "x", "b", "z"]


def test_session_dates_and_time_questions() -> None:
    assert session_date_text("1:56 pm on 8 May, 2023") == "8 May, 2023"
    assert session_date_text("2023-05-08T13:56:00") == "8 May 2023"
    assert session_date_text(None) == "" and session_date_text("") == ""
    assert keyword_document("Alice went camping.", "1:56 pm on 8 May, 2023", "We camped!") == "Alice went camping. 8 May, 2023 We camped!"
    for q in ("When did Caroline go to the support group?", "What did she do in May 2023?", "How long has he danced?"):
        assert is_time_question(q)
    for q in ("What is Caroline's identity?", "Where has Melanie camped?"):
        assert not is_time_question(q)


def test_settings_nest_in_memory_settings_and_reject_unknown_fields() -> None:
    settings = MemorySettings(retrieval={"retriever": "dense"})
    assert settings.retrieval.retriever == "dense" and MemorySettings().retrieval.retriever == "hybrid"
    with pytest.raises(ValueError):
        RetrievalSettings(retriver="dense")  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        RetrievalSettings(retriever="bm25")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- Retriever
def record(fact_id: str, user: str, text: str, source: str | None = None, session: str | None = None) -> FactRecord:
    now = time.time()
    return FactRecord(fact_id=fact_id, user_id=user, text=text, source_id=source, session_time=session, created_at=now, updated_at=now)


class InStep:
    """A vector index and a Retriever written together, as MemoryShard does (track_version / forget / delete_all)."""

    def __init__(self, settings: RetrievalSettings, dim: int = 16, seed: int = 0) -> None:
        self.index = ExactIndex(dim, "cpu")
        self.retriever = Retriever(settings, self.index, context_of=lambda user, ids: [f"turn {i} text" for i in ids])
        self.rng = np.random.default_rng(seed)
        self.dim = dim

    def add(self, rec: FactRecord, vector: np.ndarray | None = None) -> None:
        v = self.rng.standard_normal(self.dim).astype(np.float32) if vector is None else vector
        self.index.add([rec.fact_id], [rec.user_id], v[None, :])
        self.retriever.track([rec])

    def forget(self, fact_id: str) -> None:
        self.index.remove([fact_id])
        self.retriever.forget(fact_id)

    def clear(self, user: str) -> None:
        self.index.clear_user(user)
        self.retriever.clear_user(user)

    def search(self, user: str, query: str, k: int = 10) -> list[str]:
        return [h.fact_id for h in self.retriever.search(user, query, self.rng.standard_normal(self.dim).astype(np.float32), k)]


@pytest.mark.parametrize("retriever", ["hybrid", "keyword"])
def test_retriever_never_returns_deleted_updated_or_foreign_facts(retriever: str) -> None:
    s = InStep(RetrievalSettings(retriever=retriever, expand="session", expand_top=3, expand_per_hit=3))
    s.add(record("violin", "alice", "Alice plays the violin.", "D1:1", "8 May 2023"))
    s.add(record("lisbon", "alice", "Alice lives in Lisbon.", "D1:2", "8 May 2023"))
    s.add(record("peanuts", "alice", "Alice is allergic to peanuts.", "D1:3", "8 May 2023"))
    s.add(record("bob-violin", "bob", "Alice plays the violin.", "D1:1", "8 May 2023"))
    assert "violin" in s.search("alice", "violin")
    s.forget("violin")
    s.add(record("lisbon", "alice", "Alice moved to Oslo.", "D1:2", "8 May 2023"))  # an update
    for query in ("violin", "Lisbon", "Which instrument do I play?", "May 2023"):
        got = s.search("alice", query)
        assert "violin" not in got and set(got) <= {"lisbon", "peanuts"}
        assert set(s.search("bob", query)) <= {"bob-violin"}
    assert s.search("alice", "Oslo")[0] == "lisbon"
    assert s.retriever.keyword.search("alice", "Lisbon", 10) == []  # the old text left the keyword index
    s.clear("alice")
    assert s.search("alice", "Oslo peanuts May 2023") == [] and s.search("bob", "violin") == ["bob-violin"]


def test_hybrid_finds_keyword_only_facts_with_score_zero_and_keeps_cosines() -> None:
    s = InStep(RetrievalSettings(candidates=2))
    q = np.ones(16, dtype=np.float32)
    s.add(record("near", "u", "Something unrelated."), q)
    s.add(record("mid", "u", "Nothing to see."), q + 0.5 * np.eye(16, dtype=np.float32)[0])
    s.add(record("word", "u", "Alice plays the violin."), -q)
    hits = s.retriever.search("u", "violin", q, 2)  # dense: near, mid; keyword: word; near and word tie at 1/11
    assert [h.fact_id for h in hits] == ["near", "word"]
    assert hits[0].score == pytest.approx(1.0, abs=1e-5) and hits[1].score == 0.0  # word came from the keyword list only


def test_session_dates_and_turn_text_reach_the_keyword_documents() -> None:
    s = InStep(RetrievalSettings(retriever="keyword"))
    s.add(record("a", "u", "Alice went camping.", "D7:3", "1:56 pm on 8 May, 2023"))
    s.add(record("b", "u", "Alice likes tea.", None, "2 June, 2023"))
    assert s.search("u", "What happened in May?") == ["a"]
    assert s.search("u", "turn D7:3") == ["a"]  # the source turn's text ("turn D7:3 text") is indexed
    plain = InStep(RetrievalSettings(retriever="keyword", session_dates=False, turn_context=False))
    plain.add(record("a", "u", "Alice went camping.", "D7:3", "1:56 pm on 8 May, 2023"))
    assert plain.search("u", "May") == [] and plain.search("u", "turn") == []


def test_dense_retriever_is_the_vector_index_alone() -> None:
    s = InStep(RetrievalSettings(retriever="dense"))
    assert s.retriever.keyword is None
    q = np.ones(16, dtype=np.float32)
    s.add(record("a", "u", "x"), q)
    s.add(record("b", "u", "y"), -q)
    assert [h.fact_id for h in s.retriever.search("u", "ignored", q, 5)] == [h.fact_id for h in s.index.search("u", q, 5)[0]]


def test_expansion_adds_same_turn_facts_after_a_strong_hit() -> None:
    s = InStep(RetrievalSettings(retriever="keyword", expand="turn", expand_top=1, expand_per_hit=2, turn_context=False, rerank="none"))
    s.add(record("hit", "u", "Alice plays the violin.", "D1:1"))
    s.add(record("same-turn", "u", "Alice practises daily.", "D1:1"))
    s.add(record("other", "u", "Bob plays the violin badly.", "D2:1"))
    assert s.search("u", "Alice violin", 2) == ["hit", "same-turn"]
    s.forget("same-turn")
    assert s.search("u", "Alice violin", 2) == ["hit", "other"]


# ---------------------------------------------------------------------------- second stage (issue 38)
def test_turn_diverse_puts_one_fact_per_turn_first() -> None:
    from memory.retrieval import turn_diverse

    turn = {"a": "D1:1", "b": "D1:1", "c": "D2:1", "d": None, "e": "D2:1", "f": "D3:1"}
    assert turn_diverse(list("abcdef"), turn.get) == ["a", "c", "d", "f", "b", "e"]
    assert turn_diverse([], turn.get) == []
    assert turn_diverse(["d", "d2"], lambda f: None) == ["d", "d2"]  # facts without a turn are all new


@pytest.mark.parametrize("retriever", ["dense", "hybrid", "keyword"])
def test_second_stage_in_step_with_the_index(retriever: str) -> None:
    """Same-turn repeats move behind other turns' facts; a deleted, updated or cleared fact's turn is
    forgotten with it; k cuts after the re-ordering; the dense path re-orders too."""
    s = InStep(RetrievalSettings(retriever=retriever, turn_context=False))
    v = np.eye(16, dtype=np.float32)
    s.add(record("a1", "u", "Alice plays the violin in Leeds.", "D1:1"), v[0])
    s.add(record("a2", "u", "Alice plays the violin every day.", "D1:1"), v[0] * 0.9 + v[1] * 0.1)
    s.add(record("b1", "u", "Alice plays violin duets with Bob.", "D2:1"), v[0] * 0.5 + v[1] * 0.5)
    s.add(record("x1", "other", "Alice plays the violin.", "D1:1"), v[0])

    def search(k: int = 10) -> list[str]:
        return [h.fact_id for h in s.retriever.search("u", "Alice violin", v[0], k)]

    assert search()[:2] == ["a1", "b1"] or search()[:2] == ["b1", "a1"]
    assert set(search()) == {"a1", "a2", "b1"} and search()[-1] == "a2"
    assert len(search(2)) == 2 and "a2" not in search(2)
    s.forget("a1")  # a2 is now the only fact of D1:1
    assert set(search(2)) == {"a2", "b1"}
    s.add(record("a2", "u", "Alice moved to Oslo.", "D3:1"), v[1])  # an update moves a2 to another turn
    assert set(search()) == {"a2", "b1"}
    s.clear("u")
    assert search() == [] and s.retriever._turn.keys() == {"x1"}
    assert [h.fact_id for h in s.retriever.search("other", "Alice violin", v[0], 5)] == ["x1"]


def test_second_stage_off_keeps_the_first_stage_order() -> None:
    s = InStep(RetrievalSettings(retriever="dense", rerank="none"))
    v = np.eye(16, dtype=np.float32)
    s.add(record("a1", "u", "one", "D1:1"), v[0])
    s.add(record("a2", "u", "two", "D1:1"), v[0] * 0.9 + v[1] * 0.1)
    s.add(record("b1", "u", "three", "D2:1"), v[0] * 0.5 + v[1] * 0.5)
    assert [h.fact_id for h in s.retriever.search("u", "", v[0], 3)] == ["a1", "a2", "b1"]
