"""KeywordIndex: per-user BM25 over fact texts (bm25s), with the fact-id semantics of VectorIndex.

One bm25s.BM25 per user, over that user's documents only, so a search never scores (or returns)
another user's fact and its cost depends on the user's fact count alone. A document is whatever
text the caller gives for a fact (memory.retrieval gives the fact, its session date and its
source turn). Adding a fact id that is present replaces its document (and its user); `remove`,
`clear_user`, `count`, `user_of`, `fact_ids`, `in` behave as in memory.index.base.VectorIndex.

bm25s has no incremental add (idf and the average document length change with every document,
and its score matrix is precomputed), so a write only marks the user dirty and the user's
index is rebuilt from the cached token lists on the next search, or earlier by `refresh()` (the
shard calls it off the chat path). Rebuild cost: docs/retrieval.md.

Tokens: lower-cased words of two or more letters or digits (bm25s' own pattern), English
stop words (bm25s' list) dropped, Snowball-stemmed with PyStemmer when `stemmer` names a
language (stemming lifted BM25 evidence recall@10 on LoCoMo from 0.53 to 0.58).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from memory.index.base import SearchHit

__all__ = ["KeywordIndex", "Tokenizer"]

_WORD = re.compile(r"(?u)\b\w\w+\b")
_OPTIONAL_BACKENDS = ("numba", "jax")  # kept out of bm25s' import (_bm25s)


def _bm25s() -> Any:
    """Import bm25s without its optional backends (this index uses the numpy one and calls get_scores,
    never bm25s' top-k selection): importing numba loads llvmlite, whose ffi object breaks vLLM's scan
    of sys.modules when an engine is built later in the same process (vllm/triton_utils/dispatcher.py:
    AttributeError); and bm25s/selection.py imports jax.lax when JAX is installed and runs a top-k on
    import, which makes JAX take its device: 75% of a GPU by default (issue 34, docs/measured.md). A name set to None in sys.modules makes its import fail."""
    if "bm25s" in sys.modules:
        return sys.modules["bm25s"]
    masked = [name for name in _OPTIONAL_BACKENDS if name not in sys.modules]
    for name in masked:
        sys.modules[name] = None  # type: ignore[assignment] # import numba / jax -> ImportError
    try:
        import bm25s  # bm25s: only where an index is built
    finally:
        for name in masked:
            del sys.modules[name]
    return bm25s


class Tokenizer:
    """Text -> BM25 tokens (see the module docstring); a stemmer name of None keeps words as they are."""

    def __init__(self, stemmer: str | None = "english", stopwords: str | None = "en") -> None:
        _bm25s()
        from bm25s.stopwords import STOPWORDS_EN  # bm25s: only where an index is built

        self.stopwords = frozenset(STOPWORDS_EN) if stopwords == "en" else frozenset()
        self._stem: Any = None
        if stemmer:
            import Stemmer  # PyStemmer

            self._stem = Stemmer.Stemmer(stemmer)

    def __call__(self, text: str) -> list[str]:
        words = [w for w in _WORD.findall(text.lower()) if w not in self.stopwords]
        return self._stem.stemWords(words) if self._stem is not None and words else words


class _UserIndex:
    """One user's documents and, unless dirty, their built BM25."""

    __slots__ = ("docs", "bm25", "ids")

    def __init__(self) -> None:
        self.docs: dict[str, list[str]] = {}  # fact id -> tokens, in insertion order
        self.bm25: Any = None  # bm25s.BM25 over `ids`, None when dirty
        self.ids: list[str] = []


class KeywordIndex:
    """Per-user BM25 with add / remove / clear_user / search; see the module docstring."""

    def __init__(self, stemmer: str | None = "english", k1: float = 1.5, b: float = 0.75, method: str = "lucene") -> None:
        self.tokenize = Tokenizer(stemmer)
        self.k1, self.b, self.method = k1, b, method
        self._users: dict[str, _UserIndex] = {}
        self._owner: dict[str, str] = {}  # fact id -> user id
        self.rebuilds = 0  # user indexes built so far (tests, stats)

    # ------------------------------------------------------------------ writes
    def add(self, fact_ids: Sequence[str], user_ids: Sequence[str], texts: Sequence[str]) -> None:
        """Insert documents; an existing fact id is replaced (new text, possibly a new user)."""
        if not (len(fact_ids) == len(user_ids) == len(texts)):
            raise ValueError("fact_ids, user_ids and texts differ in length")
        for fact_id, user_id, text in zip(fact_ids, user_ids, texts):
            old = self._owner.get(fact_id)
            if old is not None and old != user_id:
                self._drop(fact_id)
            user = self._users.setdefault(user_id, _UserIndex())
            user.docs.pop(fact_id, None)  # a replaced document moves to the end, as a new one
            user.docs[fact_id] = self.tokenize(text)
            user.bm25 = None
            self._owner[fact_id] = user_id

    def remove(self, fact_ids: Sequence[str]) -> int:
        """Delete documents; unknown ids are ignored. Returns how many were removed."""
        return sum(self._drop(fact_id) for fact_id in fact_ids)

    def clear_user(self, user_id: str) -> int:
        """Delete all of a user's documents. Returns how many were removed."""
        user = self._users.pop(user_id, None)
        if user is None:
            return 0
        for fact_id in user.docs:
            del self._owner[fact_id]
        return len(user.docs)

    def _drop(self, fact_id: str) -> bool:
        user_id = self._owner.pop(fact_id, None)
        if user_id is None:
            return False
        user = self._users[user_id]
        del user.docs[fact_id]
        user.bm25 = None
        if not user.docs:
            del self._users[user_id]
        return True

    # ------------------------------------------------------------------ building
    def refresh(self, user_id: str | None = None) -> int:
        """Build the BM25 of every dirty user (or of one user) now; returns how many were built."""
        users = [user_id] if user_id is not None else list(self._users)
        built = 0
        for uid in users:
            user = self._users.get(uid)
            if user is not None and user.bm25 is None:
                self._build(user)
                built += 1
        return built

    def dirty_users(self) -> int:
        return sum(1 for user in self._users.values() if user.bm25 is None)

    def _build(self, user: _UserIndex) -> None:
        bm25 = _bm25s().BM25(k1=self.k1, b=self.b, method=self.method)
        user.ids = list(user.docs)
        bm25.index([user.docs[i] or [""] for i in user.ids], show_progress=False)
        user.bm25 = bm25
        self.rebuilds += 1

    # ------------------------------------------------------------------ reads
    def search(self, user_id: str, query: str, k: int) -> list[SearchHit]:
        """The user's top-k documents for `query` by BM25 score, best first; only documents that
        share a token with the query (score > 0). Ties keep insertion order."""
        user = self._users.get(user_id)
        if user is None or k <= 0:
            return []
        if user.bm25 is None:
            self._build(user)
        vocab = user.bm25.vocab_dict
        token_ids = [vocab[t] for t in self.tokenize(query) if t in vocab and t]
        if not token_ids:
            return []
        scores = user.bm25.get_scores(token_ids)
        n = len(scores)
        top = np.argpartition(-scores, k - 1)[:k] if k < n else np.arange(n)
        top = top[np.lexsort((top, -scores[top]))]  # best first, then insertion order
        ids = user.ids
        return [SearchHit(ids[i], float(scores[i])) for i in top if scores[i] > 0]

    # ------------------------------------------------------------------ bookkeeping
    def __len__(self) -> int:
        return len(self._owner)

    def count(self, user_id: str) -> int:
        user = self._users.get(user_id)
        return 0 if user is None else len(user.docs)

    def __contains__(self, fact_id: object) -> bool:
        return fact_id in self._owner

    def user_of(self, fact_id: str) -> str | None:
        return self._owner.get(fact_id)

    def fact_ids(self, user_id: str) -> list[str]:
        user = self._users.get(user_id)
        return [] if user is None else list(user.docs)
