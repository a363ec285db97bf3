"""LoCoMo scoring (bench/quality/locomo_scoring.py) on hand-computed cases, and the result bookkeeping of
bench/quality/locomo_qa.py (runs keyed by settings, the headline run). Pure: no service, no engine.

The F1 cases use nltk's PorterStemmer (in the `test` extra, so they run in CI). Each expected
value below is worked out in the comment next to it.
"""

from __future__ import annotations

import pytest

from bench.kit.results import percentile
from bench.quality.locomo_qa import merge_run
from bench.quality.locomo_scoring import (
    adversarial_score,
    category_means,
    evidence_ids,
    evidence_recall,
    f1_score,
    multi_hop_f1,
    normalize_answer,
    score_answer,
    starts_like_list,
)


@pytest.fixture
def porter() -> None:
    """The F1 cases need the stemmer: import it here so a missing nltk fails them loudly."""
    import nltk.stem  # noqa: F401


# ---------------------------------------------------------------- normalization (no stemmer)
def test_normalize_answer() -> None:
    # ',' dropped, lowercased, '!' dropped, 'the' / 'and' / 'a' dropped, whitespace collapsed
    assert normalize_answer("The Cat, and a Dog!") == "cat dog"
    # articles only as whole words: 'Banana', 'Andes' and 'theme' keep their letters
    assert normalize_answer("Banana Andes theme") == "banana andes theme"
    # punctuation is removed, not replaced by a space: 'sand-castle' -> 'sandcastle'
    assert normalize_answer("  A sand-castle\t(2023)  ") == "sandcastle 2023"


# ---------------------------------------------------------------- F1 (Porter stemming)
def test_f1_uses_porter_stems(porter: None) -> None:
    assert f1_score("dogs", "dog") == 1.0  # 'dogs' -> 'dog'; without stemming this is 0
    # pred [run, dog], gold [dog, ran]: 1 common, P = R = 1/2, F1 = 1/2
    assert f1_score("running dogs", "dog ran") == pytest.approx(0.5)


def test_f1_counts_and_edges(porter: None) -> None:
    # word order and the comma do not matter: {7, may, 2023} on both sides
    assert f1_score("7 May 2023", "May 7, 2023") == 1.0
    # pred [on, 7, may], gold [7, may, 2023]: 2 common, P = R = 2/3, F1 = 2/3
    assert f1_score("on 7 May", "7 May 2023") == pytest.approx(2 / 3)
    # multiset overlap: pred [cat, cat] ('the' dropped), gold [cat]: 1 common, P = 1/2, R = 1, F1 = 2/3
    assert f1_score("the the cat cat", "cat") == pytest.approx(2 / 3)
    assert f1_score("Berlin", "Paris") == 0.0
    assert f1_score("", "Paris") == 0.0
    assert f1_score("The.", "Paris") == 0.0  # nothing left after normalization


def test_multi_hop_splits_on_commas(porter: None) -> None:
    # one predicted part [london, pari] ('and' dropped); gold parts:
    #   Paris  [pari]   -> 1 common, P = 1/2, R = 1 -> 2/3
    #   London [london] -> 2/3
    #   Rome   [rome]   -> 0
    # mean = (2/3 + 2/3 + 0) / 3 = 4/9
    assert multi_hop_f1("London and Paris", "Paris, London, Rome") == pytest.approx(4 / 9)
    # parts Paris -> 1, London -> 1, Rome -> 0: mean 2/3
    assert multi_hop_f1("Paris, London", "Paris, London, Rome") == pytest.approx(2 / 3)
    assert score_answer("Paris, London", "Paris, London, Rome", 1) == pytest.approx(2 / 3)
    # the same pair without splitting (category 4): pred [pari, london], gold [pari, london, rome]:
    # P = 1, R = 2/3, F1 = 0.8
    assert score_answer("Paris, London", "Paris, London, Rome", 4) == pytest.approx(0.8)
    assert score_answer("Paris, London", "Paris, London, Rome", 2) == pytest.approx(0.8)


def test_open_domain_uses_first_part(porter: None) -> None:
    # category 3: gold 'Likely yes' -> [like, ye]; the prediction matches it exactly
    assert score_answer("likely yes", "Likely yes; she enjoys hiking", 3) == 1.0
    # category 4 keeps the whole gold [like, ye, she, enjoy, hike]: P = 1, R = 2/5, F1 = 4/7
    assert score_answer("likely yes", "Likely yes; she enjoys hiking", 4) == pytest.approx(4 / 7)


def test_integer_gold(porter: None) -> None:
    assert score_answer("2022.", 2022, 2) == 1.0  # the int gold is read as the string '2022'
    # pred [in, 2022] ('in' is no article), gold [2022]: P = 1/2, R = 1, F1 = 2/3
    assert score_answer("In 2022", 2022, 2) == pytest.approx(2 / 3)


def test_unknown_category(porter: None) -> None:
    with pytest.raises(ValueError):
        score_answer("x", "x", 6)


# ---------------------------------------------------------------- adversarial (no stemmer)
def test_adversarial() -> None:
    assert adversarial_score("Not mentioned in the conversation.") == 1.0
    assert adversarial_score("NO INFORMATION AVAILABLE") == 1.0
    assert adversarial_score("Nothing is mentioned about it") == 0.0
    assert adversarial_score("The information is not available") == 0.0
    assert adversarial_score("Being present with her family") == 0.0
    # the gold answer is ignored: a correct-looking answer to an adversarial question scores 0
    assert score_answer("Being present with her family", None, 5) == 0.0
    assert score_answer("That is not mentioned.", "Being present", 5) == 1.0


# ---------------------------------------------------------------- report helpers (no stemmer)
def test_starts_like_list() -> None:
    for text in ("- a cat", "* a cat", "• a cat", "1. a cat", "2) a cat", "  3. a cat"):
        assert starts_like_list(text), text
    for text in ("Paris", "10 May 2023", "1990 was a year", "", "a - b"):
        assert not starts_like_list(text), text


def test_evidence_ids() -> None:
    assert evidence_ids(["D8:6; D9:17"]) == ["D8:6", "D9:17"]
    assert evidence_ids(["D1:18", "D", "D1:20"]) == ["D1:18", "D1:20"]
    assert evidence_ids(["D:11:26", "D11:26", "D2:03"]) == ["D11:26", "D2:3"]
    assert evidence_ids("D1:3") == ["D1:3"]
    assert evidence_ids([]) == []


def test_evidence_recall() -> None:
    assert evidence_recall(["D1:3", "D2:4"], ["D1:3", "D5:5"]) == 0.5
    assert evidence_recall(["D1:3", "D2:4"], {"D2:4", "D1:3"}) == 1.0
    assert evidence_recall(["D1:3"], []) == 0.0
    assert evidence_recall([], ["D1:3"]) is None


def test_percentile() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)  # between the 2nd and 3rd of 1..4
    # 1..10: rank 9 * 0.9 = 8.1 -> 9 + 0.1 * (10 - 9) = 9.1
    assert percentile([float(v) for v in range(10, 0, -1)], 90) == pytest.approx(9.1)
    assert percentile([7.0], 90) == 7.0
    assert percentile([], 50) is None


def test_category_means() -> None:
    means = category_means([(1, 0.5), (1, 1.0), (4, 0.0), (2, None)])
    assert means == {"overall": 0.5, "1": 0.75, "2": None, "3": None, "4": 0.0, "5": None}
    assert category_means([]) == {"overall": None, "1": None, "2": None, "3": None, "4": None, "5": None}


# ---------------------------------------------------------------- result bookkeeping
def _run(k: int, window: int, f1: float, tag: str = "t") -> dict:
    settings = {"k": k, "window": window, "model": "m", "conversations": ["conv-26"], "run_tag": tag}
    return {"settings": settings, "f1": {"kv": {"overall": f1}}}


def test_merge_run_keys_by_settings_and_picks_headline() -> None:
    doc = merge_run({}, _run(5, 5, 0.1))
    assert [r["settings"]["k"] for r in doc["runs"]] == [5]
    assert doc["f1"]["kv"]["overall"] == 0.1  # no k=10, w=5 run yet: the latest
    doc = merge_run(doc, _run(10, 5, 0.2))
    doc = merge_run(doc, _run(20, 5, 0.3))
    assert [r["settings"]["k"] for r in doc["runs"]] == [5, 10, 20]
    assert doc["f1"]["kv"]["overall"] == 0.2 and doc["settings"]["k"] == 10  # k=10, w=5 wins
    doc = merge_run(doc, _run(10, 5, 0.4))  # same settings: replaced, not appended
    assert [r["f1"]["kv"]["overall"] for r in doc["runs"]] == [0.1, 0.3, 0.4]
    assert doc["f1"]["kv"]["overall"] == 0.4
    doc = merge_run(doc, _run(10, 20, 0.5))  # another window: appended; the headline stays w=5
    assert len(doc["runs"]) == 4 and doc["f1"]["kv"]["overall"] == 0.4
