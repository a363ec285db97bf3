"""Vector index: exact search against a numpy reference, user isolation, delete/update, k and
empty-user edge cases; CagraIndex bookkeeping (routing, bitsets, tombstones, extend, rebuild)
against a brute-force stand-in for cuVS, and on a real GPU when cuVS is importable; Embedder."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from memory.index import (
    CagraIndex,
    ExactIndex,
    IndexSettings,
    SearchHit,
    build_index,
    cuvs_available,
)
from memory.index.cuvs_interop import pack_bits

DIM = 32


def unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def reference(store: dict[str, tuple[str, np.ndarray]], user: str, q: np.ndarray, k: int) -> list[list[tuple[str, float]]]:
    """Brute force in numpy over a {fact: (user, vector)} model."""
    ids = [f for f, (u, _) in store.items() if u == user]
    if not ids:
        return [[] for _ in range(len(q))]
    mat = unit(np.stack([store[f][1] for f in ids]))
    scores = unit(q) @ mat.T
    out = []
    for row in scores:
        order = np.argsort(-row, kind="stable")[:k]
        out.append([(ids[j], float(row[j])) for j in order])
    return out


def assert_same(got: list[list[SearchHit]], want: list[list[tuple[str, float]]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert [h.fact_id for h in g] == [f for f, _ in w]
        np.testing.assert_allclose([h.score for h in g], [s for _, s in w], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- a cuVS stand-in


def fake_cuvs(old_extend: bool = False, opaque: bool = False) -> tuple[types.SimpleNamespace, types.SimpleNamespace]:
    """Brute-force cagra/filters with cuVS's calling conventions: uint32 neighbours, 0xFFFFFFFF
    where fewer than k rows pass the bitset, build failing on tiny datasets, extend in the
    26.10 form (old || new rows + new_start_row) or the older one (new rows, returns index);
    `opaque` hides extend's signature and docstring behind a (*args, **kwargs) wrapper."""
    calls = {"build": 0, "extend": 0, "search": 0}

    class Index:
        def __init__(self, data: torch.Tensor) -> None:
            self.data = data

    def build(params, dataset, resources=None):
        calls["build"] += 1
        if dataset.shape[0] < 128:
            raise RuntimeError("CAGRA cannot build on so few rows")
        return Index(dataset)

    def search(sp, index, queries, k, neighbors=None, distances=None, resources=None, filter=None):
        calls["search"] += 1
        assert sp.itopk_size >= k
        s = queries @ index.data.T
        if filter is not None:
            bits = np.unpackbits(filter.cpu().numpy().view(np.uint8), bitorder="little")[: index.data.shape[0]]
            s[:, torch.from_numpy(bits == 0)] = float("-inf")
        top, idx = torch.topk(s, k, dim=1)
        nb = idx.numpy().astype(np.uint32)
        nb[np.isinf(top.numpy())] = 0xFFFFFFFF
        return (2 - 2 * top).numpy(), nb

    if old_extend:

        def extend(params, index, additional_dataset, resources=None):
            calls["extend"] += 1
            return Index(torch.cat([index.data, additional_dataset]))

    else:

        def extend(params, index, extended_dataset, new_start_row, resources=None):
            calls["extend"] += 1
            assert new_start_row == index.data.shape[0]
            assert torch.equal(extended_dataset[:new_start_row], index.data)
            index.data = extended_dataset
            return index

    if opaque:
        inner = extend

        def extend(*args, resources=None, **kwargs):  # noqa: F811
            return inner(*args, **kwargs)

    cagra = types.SimpleNamespace(
        IndexParams=lambda **kw: kw,
        SearchParams=lambda itopk_size=64, **kw: types.SimpleNamespace(itopk_size=itopk_size),
        ExtendParams=lambda **kw: kw,
        build=build,
        search=search,
        extend=extend,
        calls=calls,
    )
    filters = types.SimpleNamespace(from_bitset=lambda words: words.tensor)
    return cagra, filters


def fake_cagra_index(old_extend: bool = False, opaque: bool = False, **kw) -> CagraIndex:
    opts = dict(cagra_min_vectors=256, exact_user_max_vectors=0, extend_min_vectors=16, itopk_size=32)
    opts.update(kw)
    return CagraIndex(DIM, "cpu", cuvs_modules=fake_cuvs(old_extend, opaque), **opts)


# ----------------------------------------------------------------------------- ExactIndex


def test_exact_matches_numpy_reference_multi_query() -> None:
    rng = np.random.default_rng(0)
    idx = ExactIndex(DIM)
    store = {}
    for u, n in (("alice", 300), ("bob", 57), ("carol", 1)):
        vecs = rng.standard_normal((n, DIM)).astype(np.float32) * 3  # not normalised on input
        ids = [f"{u}-{i}" for i in range(n)]
        idx.add(ids, [u] * n, vecs)
        store.update({f: (u, v) for f, v in zip(ids, vecs)})
    q = rng.standard_normal((4, DIM)).astype(np.float32)
    for user in ("alice", "bob", "carol"):
        assert_same(idx.search(user, q, 10), reference(store, user, q, 10))
    one = idx.search("alice", q[0], 5)  # a [d] query gives one result list
    assert len(one) == 1 and [h.fact_id for h in one[0]] == [f for f, _ in reference(store, "alice", q[:1], 5)[0]]
    assert len(idx) == 358 and idx.count("bob") == 57 and "carol-0" in idx and idx.user_of("bob-3") == "bob"


def test_user_isolation_with_identical_vectors() -> None:
    rng = np.random.default_rng(1)
    vecs = rng.standard_normal((20, DIM)).astype(np.float32)
    idx = ExactIndex(DIM)
    idx.add([f"a{i}" for i in range(20)], ["a"] * 20, vecs)
    idx.add([f"b{i}" for i in range(20)], ["b"] * 20, vecs)
    for user in ("a", "b"):
        hits = idx.search(user, vecs, 100)
        assert all(h.fact_id.startswith(user) for row in hits for h in row)
        assert all(len(row) == 20 for row in hits)
        assert [row[0].fact_id for row in hits] == [f"{user}{i}" for i in range(20)]


def test_delete_update_and_move_between_users() -> None:
    rng = np.random.default_rng(2)
    vecs = unit(rng.standard_normal((50, DIM)))
    idx = ExactIndex(DIM)
    idx.add([f"f{i}" for i in range(50)], ["u"] * 50, vecs)
    assert idx.remove(["f3", "f10", "missing", "f3"]) == 2
    got = {h.fact_id for h in idx.search("u", vecs, 50)[0]}
    assert got.isdisjoint({"f3", "f10"}) and len(got) == 48
    assert idx.search("u", vecs[3], 1)[0][0].fact_id != "f3"
    # Update in place: f7 takes f20's direction and is found first for it (score 1).
    idx.add(["f7"], ["u"], vecs[20] * 5)
    top = idx.search("u", vecs[20], 2)[0]
    assert {h.fact_id for h in top} == {"f7", "f20"} and top[0].score == pytest.approx(1.0, abs=1e-5)
    assert np.allclose(idx.vector("f7"), vecs[20], atol=1e-6)
    # Moving a fact to another user removes it from the first.
    idx.add(["f8"], ["v"], vecs[8])
    assert idx.count("u") == 47 and idx.count("v") == 1 and idx.user_of("f8") == "v"
    assert all(h.fact_id != "f8" for h in idx.search("u", vecs[8], 50)[0])
    assert idx.search("v", vecs[8], 5)[0][0].fact_id == "f8"
    # Re-adding a removed id brings it back.
    idx.add(["f3"], ["u"], vecs[3])
    assert idx.search("u", vecs[3], 1)[0][0].fact_id == "f3"


def test_k_edge_cases_and_empty_user() -> None:
    rng = np.random.default_rng(3)
    idx = ExactIndex(DIM)
    idx.add(["x", "y", "z"], ["u"] * 3, rng.standard_normal((3, DIM)))
    q = rng.standard_normal((2, DIM))
    res = idx.search("u", q, 50)
    assert [len(r) for r in res] == [3, 3]
    assert all(r[0].score >= r[1].score >= r[2].score for r in res)
    assert idx.search("u", q, 0) == [[], []]
    assert idx.search("nobody", q, 5) == [[], []]
    assert idx.search("nobody", q[0], 5) == [[]]
    assert idx.clear_user("u") == 3 and len(idx) == 0 and idx.search("u", q, 5) == [[], []]
    assert idx.clear_user("u") == 0
    with pytest.raises(ValueError):
        idx.add(["a"], ["u"], rng.standard_normal((1, DIM + 1)))
    with pytest.raises(ValueError):
        idx.add(["a", "b"], ["u"], rng.standard_normal((2, DIM)))


def test_duplicate_ids_in_one_batch_keep_the_last() -> None:
    v = unit(np.eye(DIM, dtype=np.float32)[:2])
    idx = ExactIndex(DIM)
    idx.add(["a", "a"], ["u", "w"], v)
    assert len(idx) == 1 and idx.user_of("a") == "w"
    assert np.allclose(idx.vector("a"), v[1])


def random_workload(idx, seed: int, steps: int = 30, users: int = 4, add_max: int = 60) -> dict[str, tuple[str, np.ndarray]]:
    """Random adds, updates, user moves, deletes and clears, mirrored in a dict model."""
    rng = np.random.default_rng(seed)
    store: dict[str, tuple[str, np.ndarray]] = {}
    next_id = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.55 or not store:
            n = int(rng.integers(1, add_max))
            ids = [f"f{next_id + i}" for i in range(n)]
            next_id += n
            if store and rng.random() < 0.5:  # mix in updates of existing ids
                m = min(n // 3, len(store))
                ids[:m] = [str(f) for f in rng.choice(list(store), size=m, replace=False)]
            us = [f"u{rng.integers(users)}" for _ in ids]
            vecs = rng.standard_normal((n, DIM)).astype(np.float32)
            idx.add(ids, us, vecs)
            for f, u, v in zip(ids, us, vecs):
                store[f] = (u, v)
        elif op < 0.95:
            ids = [str(f) for f in rng.choice(list(store), size=min(len(store), int(rng.integers(1, 40))), replace=False)]
            assert idx.remove(ids + ["never-added"]) == len(ids)
            for f in ids:
                del store[f]
        else:
            u = f"u{rng.integers(users)}"
            gone = [f for f, (o, _) in store.items() if o == u]
            assert idx.clear_user(u) == len(gone)
            for f in gone:
                del store[f]
    return store


def check_against_model(idx, store, seed: int, users: int = 4, k: int = 7) -> None:
    q = np.random.default_rng(seed + 100).standard_normal((3, DIM)).astype(np.float32)
    assert len(idx) == len(store)
    for u in [f"u{i}" for i in range(users)]:
        assert idx.count(u) == sum(o == u for o, _ in store.values())
        assert_same(idx.search(u, q, k), reference(store, u, q, k))
        assert_same(idx.search(u, q, 10_000), reference(store, u, q, 10_000))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_random_workload_matches_model(seed: int) -> None:
    idx = ExactIndex(DIM, initial_capacity=4)  # small capacity: growth paths run too
    store = random_workload(idx, seed)
    check_against_model(idx, store, seed)


_WORDS = ("violin", "lisbon", "chess", "camping", "pottery", "sunrise", "beach", "dance")


def _text_of(v: np.ndarray) -> str:
    return f"fact about {_WORDS[int(np.argmax(v[: len(_WORDS)]))]}"


class _IndexWithRetriever:
    """An ExactIndex and a memory.retrieval.Retriever (its keyword index) written together, as
    MemoryShard does: add = track_version, remove = forget, clear_user = delete_all."""

    def __init__(self) -> None:
        from memory.retrieval import RetrievalSettings, Retriever

        self.index = ExactIndex(DIM, initial_capacity=4)
        self.retriever = Retriever(RetrievalSettings(expand="session"), self.index)

    def add(self, ids, users, vecs) -> None:
        from memory.fact_store import FactRecord

        self.index.add(ids, users, vecs)
        last = {f: (u, v) for f, u, v in zip(ids, users, vecs)}  # a duplicate id keeps the last row
        self.retriever.track(
            FactRecord(fact_id=f, user_id=u, text=_text_of(v), session_time="8 May 2023", created_at=0.0, updated_at=0.0)
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
    both = _IndexWithRetriever()
    store = random_workload(both, seed)
    check_against_model(both.index, store, seed)
    keyword = both.retriever.keyword
    assert len(keyword) == len(both.index) == len(store)
    q = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    for u in [f"u{i}" for i in range(4)]:
        mine = {f for f, (o, _) in store.items() if o == u}
        assert set(keyword.fact_ids(u)) == mine
        for word in _WORDS[:3]:
            want = {f for f in mine if _text_of(store[f][1]).endswith(word)}
            assert {h.fact_id for h in keyword.search(u, word, 10_000)} == want
            hybrid = {h.fact_id for h in both.retriever.search(u, f"{word} in May", q, 50)}
            assert hybrid <= mine and len(hybrid) == min(50, len(mine))  # never a removed, moved or foreign fact


# ----------------------------------------------------------------------------- CagraIndex bookkeeping


def test_pack_bits_layout() -> None:
    mask = np.zeros(70, dtype=bool)
    mask[[0, 5, 31, 32, 69]] = True
    words = pack_bits(mask)
    assert words.dtype == np.dtype("<u4") and words.size == 3
    assert words[0] == (1 << 0) | (1 << 5) | (1 << 31) and words[1] == 1 and words[2] == 1 << 5


@pytest.mark.parametrize(
    ("old_extend", "opaque"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["extend-26.10", "extend-older", "extend-26.10-opaque", "extend-older-opaque"],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_cagra_bookkeeping_random_workload(old_extend: bool, opaque: bool, seed: int) -> None:
    """Every search forced onto the graph path (exact_user_max_vectors=0) must equal brute force."""
    idx = fake_cagra_index(old_extend, opaque)
    store = random_workload(idx, seed, steps=40, add_max=150)
    calls = idx.cagra.calls
    assert calls["build"] >= 1 and calls["extend"] >= 1, calls
    assert idx.extend_style == ("old" if old_extend else "new") and idx.last_error is None
    if len(store) >= idx.cagra_min_vectors:
        assert idx.has_graph
    searches = calls["search"]
    check_against_model(idx, store, seed)
    if idx.has_graph:
        assert calls["search"] > searches  # the graph path really answered
    idx.flush()
    check_against_model(idx, store, seed)
    idx.rebuild()
    assert idx.tombstones == 0
    check_against_model(idx, store, seed)


def test_cagra_routing_thresholds_and_tombstone_rebuild() -> None:
    rng = np.random.default_rng(5)
    idx = fake_cagra_index(cagra_min_vectors=300, exact_user_max_vectors=100, extend_min_vectors=50, rebuild_tombstone_fraction=0.2)
    small = rng.standard_normal((100, DIM)).astype(np.float32)
    idx.add([f"s{i}" for i in range(100)], ["small"] * 100, small)
    assert not idx.has_graph and idx.route("small", 5) == "exact"  # below cagra_min_vectors
    big = rng.standard_normal((400, DIM)).astype(np.float32)
    idx.add([f"b{i}" for i in range(400)], ["big"] * 400, big)
    assert idx.has_graph and idx.graph_rows == 500 and idx.cagra.calls["build"] == 1
    assert idx.route("small", 5) == "exact"  # user at or below exact_user_max_vectors
    assert idx.route("big", 5) == "cagra"
    assert idx.route("big", 400) == "exact"  # k >= the user's facts: return them all exactly
    # Pending rows are found before the extend, and by the graph after it.
    new = rng.standard_normal((10, DIM)).astype(np.float32)
    idx.add([f"n{i}" for i in range(10)], ["big"] * 10, new)
    assert idx.pending_rows == 10 and idx.search("big", new[3], 1)[0][0].fact_id == "n3"
    idx.add([f"m{i}" for i in range(45)], ["big"] * 45, rng.standard_normal((45, DIM)))
    assert idx.pending_rows == 0 and idx.cagra.calls["extend"] == 1
    # Deleted rows never come back; past the tombstone fraction the graph is rebuilt compactly.
    idx.remove([f"b{i}" for i in range(50)])
    assert idx.tombstones == 50 and idx.has_graph
    assert not any(h.fact_id in {f"b{i}" for i in range(50)} for row in idx.search("big", big[:50], 20) for h in row)
    idx.remove([f"b{i}" for i in range(50, 120)])
    assert idx.tombstones == 0 and idx.cagra.calls["build"] == 2 and idx.graph_rows == len(idx) == 100 + 400 - 120 + 55
    # Shrinking far below the threshold drops the graph; searches stay exact and correct.
    idx.clear_user("big")
    assert not idx.has_graph and idx.search("small", small[7], 1)[0][0].fact_id == "s7"
    assert idx.search("big", small[7], 3) == [[]]


def test_cagra_rows_of_updated_facts_do_not_pile_up_without_a_graph() -> None:
    """Below cagra_min_vectors there is no graph to rebuild; re-adding (updating) facts must
    still compact the dead rows away, or a small busy index grows without bound."""
    rng = np.random.default_rng(8)
    idx = fake_cagra_index(cagra_min_vectors=10_000, rebuild_tombstone_fraction=0.2)
    ids = [f"f{i}" for i in range(50)]
    for _ in range(200):
        idx.add(ids, ["u"] * 50, rng.standard_normal((50, DIM)).astype(np.float32))
    assert not idx.has_graph and len(idx) == 50
    assert idx.tombstones <= 0.2 * 250 and idx.stored_rows <= 250  # compacted, not 10,000 rows
    last = rng.standard_normal((50, DIM)).astype(np.float32)
    idx.add(ids, ["u"] * 50, last)
    assert idx.search("u", last[9], 1)[0][0].fact_id == "f9"


def test_cagra_failed_build_keeps_serving_exactly() -> None:
    cagra, filters = fake_cuvs()

    def broken(params, dataset, resources=None):
        raise RuntimeError("out of memory")

    cagra.build = broken
    idx = CagraIndex(DIM, "cpu", cuvs_modules=(cagra, filters), cagra_min_vectors=256)
    rng = np.random.default_rng(6)
    v = rng.standard_normal((300, DIM)).astype(np.float32)
    with pytest.warns(RuntimeWarning, match="out of memory"):
        idx.add([f"f{i}" for i in range(300)], ["u"] * 300, v)
    assert not idx.has_graph and "out of memory" in (idx.last_error or "")
    assert idx.search("u", v[17], 1)[0][0].fact_id == "f17"


def test_settings_and_build_index() -> None:
    s = IndexSettings()
    assert s.backend == "auto" and s.cagra_min_vectors == 10_000
    assert isinstance(build_index(IndexSettings(backend="exact", device="cpu"), DIM), ExactIndex)
    if not cuvs_available():
        assert isinstance(build_index(IndexSettings(device="auto"), DIM), ExactIndex)
    with pytest.raises(ValueError):
        build_index(IndexSettings(backend="cagra", device="cpu"), DIM)
    with pytest.raises(ValueError):
        IndexSettings(cagra_min_vectors=10)
    with pytest.raises(ValueError):
        IndexSettings(unknown_field=1)


# ----------------------------------------------------------------------------- Embedder


@pytest.fixture(scope="module")
def embedder(minilm_dir):
    from memory.embedder import Embedder

    return Embedder(minilm_dir, device="cpu")


def test_embedder_paraphrases_closer_than_unrelated(embedder) -> None:
    v = embedder.embed(
        [
            "Caroline adopted a dog named Rex last spring.",
            "Last spring Caroline got a dog and called him Rex.",
            "The quarterly earnings report beat analyst expectations.",
        ]
    )
    assert v.shape == (3, 384) and v.dtype == np.float32 and embedder.dim == 384
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2] + 0.3
    assert embedder.embed([]).shape == (0, 384)
    assert embedder.embed("one sentence").shape == (1, 384)

