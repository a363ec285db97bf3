"""LoCoMo's answer scoring, reimplemented from the benchmark's own evaluation code, plus the
small pure helpers bench/quality/locomo_qa.py reports with (evidence recall, list-shaped answers,
per-category means). Details: docs/bench.md."""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import lru_cache
from typing import Any, Callable, Iterable, Sequence

CATEGORIES: dict[int, str] = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
ADVERSARIAL_MARKERS = ("no information available", "not mentioned")
LIST_ITEM = re.compile(r"^\s*([-*•]|\d+[.)])")
_ARTICLES = re.compile(r"\b(a|an|the|and)\b")
_PUNCTUATION = frozenset(string.punctuation)
_DIA_ID = re.compile(r"D:?(\d+):(\d+)")


@lru_cache(maxsize=1)
def _porter() -> Callable[[str], str]:
    from nltk.stem import PorterStemmer  # the `bench` extra

    return PorterStemmer().stem


def normalize_answer(text: str) -> str:
    """LoCoMo's normalize_answer: 'The Cat, and a Dog!' -> 'cat dog'."""
    text = text.replace(",", "").lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def answer_tokens(text: str) -> list[str]:
    """Normalized, Porter-stemmed tokens of an answer."""
    stem = _porter()
    return [stem(word) for word in normalize_answer(text).split()]


def f1_score(prediction: str, gold: str) -> float:
    """Token F1 of two answers (LoCoMo's f1_score); 0.0 when they share no token."""
    predicted, expected = answer_tokens(prediction), answer_tokens(gold)
    same = sum((Counter(predicted) & Counter(expected)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(expected)
    return 2 * precision * recall / (precision + recall)


def multi_hop_f1(prediction: str, gold: str) -> float:
    """Category 1: mean over the gold's ','-parts of the best F1 against any predicted part."""
    predicted = [part.strip() for part in prediction.split(",")]
    expected = [part.strip() for part in gold.split(",")]
    return sum(max(f1_score(p, g) for p in predicted) for g in expected) / len(expected)


def adversarial_score(prediction: str) -> float:
    """Category 5: 1.0 when the model says the conversation does not hold the answer."""
    lowered = prediction.lower()
    return 1.0 if any(marker in lowered for marker in ADVERSARIAL_MARKERS) else 0.0


def score_answer(prediction: str, answer: Any, category: int) -> float:
    """The LoCoMo score of one prediction; `answer` may be an int (a few are) or None (category 5)."""
    if category == 5:
        return adversarial_score(prediction)
    gold = str(answer)
    if category == 1:
        return multi_hop_f1(prediction, gold)
    if category == 3:
        return f1_score(prediction, gold.split(";")[0].strip())
    if category in (2, 4):
        return f1_score(prediction, gold)
    raise ValueError(f"LoCoMo has categories 1-5, not {category!r}")


def starts_like_list(text: str) -> bool:
    """True when an answer opens like a list item ('- x', '* x', '• x', '1. x', '2) x')."""
    return LIST_ITEM.match(text) is not None


def evidence_ids(raw: Any) -> list[str]:
    """Canonical dialogue ids of a question's evidence, in order, without repeats:
    ['D8:6; D9:17'] -> ['D8:6', 'D9:17']; 'D:11:26' -> 'D11:26'; an entry 'D' is dropped."""
    out: list[str] = []
    for item in raw if isinstance(raw, list) else [raw]:
        for match in _DIA_ID.finditer(str(item)):
            dia = f"D{int(match.group(1))}:{int(match.group(2))}"
            if dia not in out:
                out.append(dia)
    return out


def evidence_recall(evidence: Sequence[str], retrieved_turns: Iterable[str]) -> float | None:
    """Share of the evidence turns that some retrieved fact came from; None without evidence."""
    if not evidence:
        return None
    covered = set(retrieved_turns)
    return sum(1 for dia in evidence if dia in covered) / len(evidence)


def category_means(scored: Iterable[tuple[int, float | None]]) -> dict[str, float | None]:
    """{"overall", "1".."5"}: the mean of the values per category and over all (None values are
    left out; a category with no value is None)."""
    by_category: dict[str, list[float]] = {str(c): [] for c in CATEGORIES}
    every: list[float] = []
    for category, value in scored:
        if value is None:
            continue
        by_category[str(category)].append(value)
        every.append(value)
    means: dict[str, float | None] = {"overall": sum(every) / len(every) if every else None}
    for key, values in by_category.items():
        means[key] = sum(values) / len(values) if values else None
    return means
