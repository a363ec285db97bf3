"""Grounding of extracted facts in the turn they came from (pure: no engine, no Redis).

The served model that extracts facts (serve_app.replica.extraction) is small and adds what the
user did not say ("I play the cello in Leeds" -> "I'm a professional musician in the UK"). A fact
is kept only when the turn it came from supports it, checked word by word:

    grounding_check(fact, turn_text, speaker) -> Grounding(grounded, missing, reason)

- content words: the fact's words less English function words (bm25s' NLTK list, the one the
  keyword index uses), less the words that name the speaker ("user", the speaker's name, pronouns);
  each must occur in the turn, compared Snowball-stemmed (PyStemmer) so "moved" matches "move";
  numbers compare as numbers ("two" matches "2");
- negation: a fact without a negation is refused when the turn negates a word it relies on
  ("I am not allergic to peanuts" never grounds "the user is allergic to peanuts");
- substance: at least `min_words` words and one content word ("Pixel" alone is not a fact).

`ground_turn(turn, facts, settings, fits)` applies both to one turn's extracted facts: the grounded
ones are kept, the others dropped with their reason, and when none is left of a turn that
states something, the turn's own text is the fact. `ExtractionReport` adds the turns up for the
add's answer (facts extracted, kept, dropped and why, turns stored as given).

`states_something(turn_text)` says whether a turn that yielded no grounded fact is itself worth
storing (as `infer=False` would store it): a sentence that is not a question, in the first
person, with at least two content words beyond greetings and fillers. Both functions are plain
and settings-driven (`GroundingSettings`), so the add path can call them wherever it extracts.
Why hand-written and not an entailment model: no NLI model ships offline here (docs/quality.md,
"Grounded extraction"); word support is strict but explainable, and every refusal names the words.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from memory.index.keyword import _bm25s
from memory.records import NewFact, Turn

__all__ = [
    "ExtractionReport",
    "Grounding",
    "GroundingSettings",
    "TurnGrounding",
    "content_words",
    "ground_turn",
    "grounding_check",
    "states_something",
]


class GroundingSettings(BaseModel):
    """How strictly an extracted fact must be supported by its turn."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Check every extracted fact against its turn; off stores what the model says.")
    max_missing: int = Field(
        0, ge=0, description="Content words of a fact that may be absent from its turn (0: every one must occur there)."
    )
    min_words: int = Field(3, ge=1, description="Fewest words a fact has (a bare name or noun is not a fact).")
    store_turn_when_empty: bool = Field(
        True, description="A user turn that states something and yields no grounded fact is stored as it is (as infer=False)."
    )
    negation_window: int = Field(3, ge=0, description="Words before a content word in which a negation negates it.")


@dataclass(frozen=True)
class Grounding:
    """The verdict on one fact: grounded, or why not (`reason`, the content words its turn lacks)."""

    grounded: bool
    reason: str = ""
    missing: tuple[str, ...] = field(default_factory=tuple)


_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)?", re.UNICODE)
_NEGATIONS = frozenset({"not", "no", "never", "nor", "neither", "nobody", "nothing", "none", "cannot", "without"})
# words that stand for the speaker, whoever extracted the fact: "The user is ...", "She likes ..."
_SPEAKER_WORDS = frozenset({"user", "users", "speaker", "person", "i", "me", "my", "mine", "myself", "we", "us", "our", "ours",
                            "he", "him", "his", "she", "her", "hers", "they", "them", "their", "theirs"})  # fmt: skip
# greetings, thanks and fillers: words that do not make a turn a statement about the speaker
_FILLERS = frozenset({"hi", "hey", "hello", "thanks", "thank", "ok", "okay", "yes", "yeah", "yep", "wow", "cool", "great",
                      "lol", "bye", "good", "nice", "sure", "awesome", "amazing", "really", "oh", "haha", "glad", "love",
                      "totally", "agree", "sounds", "see", "know", "think", "right", "well", "soon", "talk", "later",
                      "take", "care", "congrats", "congratulations", "happy"})  # fmt: skip
_FIRST_PERSON = frozenset({"i", "i'm", "i've", "i'd", "i'll", "me", "my", "mine", "myself", "we", "we're", "we've", "our", "us"})
_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen twenty".split())}  # fmt: skip
_CONTRACTIONS = (("n't", " not"), ("'m", ""), ("'re", ""), ("'ve", ""), ("'ll", ""), ("'d", ""), ("'s", ""))


@lru_cache(maxsize=1)
def _tools() -> tuple[frozenset[str], Any]:
    """English function words (bm25s' NLTK list, as the keyword index) and a Snowball stemmer."""
    _bm25s()  # bm25s without numba (see memory.index.keyword)
    import Stemmer  # PyStemmer and bm25s: not in `serve run`'s driver
    from bm25s.stopwords import STOPWORDS_EN_PLUS

    return frozenset(STOPWORDS_EN_PLUS) - _NEGATIONS, Stemmer.Stemmer("english")


def _words(text: str) -> list[str]:
    """Lower-cased words; contractions split off ("don't" -> "do", "not"; "I'm" -> "i")."""
    text = text.lower().replace("\u2019", "'")
    for short, long in _CONTRACTIONS:
        text = text.replace(short, long)
    return _WORD.findall(text)


def _key(word: str, stem: Any) -> str:
    """What two words are compared by: a number's digits, else the word's stem."""
    if word in _NUMBER_WORDS:
        return _NUMBER_WORDS[word]
    return word if word.isdigit() else stem.stemWord(word)


def content_words(text: str, speaker: str | None = None) -> list[str]:
    """The words of `text` that carry its content: not function words, not the speaker's name."""
    stop, _ = _tools()
    names = set(_words(speaker)) if speaker else set()
    return [w for w in _words(text) if w not in stop and w not in _SPEAKER_WORDS and w not in names and w not in _NEGATIONS]


def grounding_check(fact: str, turn: str, speaker: str | None = None, settings: GroundingSettings | None = None) -> Grounding:
    """Whether `turn` (said by `speaker`) supports `fact`: see the module docstring."""
    s = settings or GroundingSettings()
    _, stem = _tools()
    fact_words = _words(fact)
    if len(fact_words) < s.min_words:
        return Grounding(False, f"fewer than {s.min_words} words")
    content = content_words(fact, speaker)
    if not content:
        return Grounding(False, "no content word")
    turn_words = _words(turn)
    turn_keys = [_key(w, stem) for w in turn_words]
    present = set(turn_keys)
    missing = tuple(dict.fromkeys(w for w in content if _key(w, stem) not in present))
    if len(missing) > s.max_missing:
        return Grounding(False, "words not in the turn: " + ", ".join(missing), missing)
    if s.negation_window and not any(w in _NEGATIONS for w in fact_words):
        for w in content:
            key = _key(w, stem)
            spots = [i for i, k in enumerate(turn_keys) if k == key]
            negated = [any(x in _NEGATIONS for x in turn_words[max(0, i - s.negation_window) : i]) for i in spots]
            if spots and all(negated):
                return Grounding(False, f"the turn negates '{w}'", (w,))
    return Grounding(True)


def states_something(turn: str) -> bool:
    """A turn worth storing as it is: a non-question sentence in the first person with at least two
    content words beyond greetings and fillers ("I am allergic to peanuts", not "Hey! How are you?")."""
    stop, _ = _tools()
    for sentence in re.split(r"(?<=[.!?])\s+|\n+", turn.strip()):
        if not sentence or sentence.rstrip().endswith("?"):
            continue
        raw = sentence.lower().replace("\u2019", "'")
        if not any(w in _FIRST_PERSON for w in _WORD.findall(raw)):
            continue
        words = [w for w in _words(sentence) if w not in stop and w not in _SPEAKER_WORDS and w not in _FILLERS]
        if len(words) >= 2:
            return True
    return False


@dataclass(frozen=True)
class TurnGrounding:
    """What one turn's extraction leaves: facts to store, facts dropped (text, reason), and whether
    the turn itself is the fact (no grounded fact was left of a turn that states something)."""

    turn_id: str
    extracted: int
    kept: list[NewFact]
    dropped: list[tuple[str, str]]
    stored_as_given: bool


def ground_turn(
    turn: Turn, facts: Sequence[str], settings: GroundingSettings | None = None, fits: Callable[[str], bool] | None = None
) -> TurnGrounding:
    """The facts the model extracted from `turn`, checked against it (see the module docstring);
    `fits` says whether a text fits one memory entry (the turn is stored as given only if it does)."""
    s = settings or GroundingSettings()
    kept: list[NewFact] = []
    dropped: list[tuple[str, str]] = []
    for text in facts:
        verdict = grounding_check(text, turn.text, turn.speaker, s) if s.enabled else Grounding(True)
        if verdict.grounded:
            kept.append(NewFact(text=text, source_id=turn.turn_id, session_time=turn.session_time))
        else:
            dropped.append((text, verdict.reason))
    as_given = False
    if not kept and s.enabled and s.store_turn_when_empty and turn.text.strip() and states_something(turn.text):
        if fits is None or fits(turn.text.strip()):
            kept.append(NewFact(text=turn.text.strip(), source_id=turn.turn_id, session_time=turn.session_time))
            as_given = True
    return TurnGrounding(turn.turn_id, len(facts), kept, dropped, as_given)


class ExtractionReport(BaseModel):
    """How an add's extraction went, for its answer: the model's facts, those kept, those dropped
    by the grounding check (with the reason), and the turns stored as given because none was left."""

    facts_extracted: int = Field(0, description="Facts the model extracted from the user's turns.")
    facts_grounded: int = Field(0, description="Extracted facts the grounding check kept.")
    facts_dropped: int = Field(0, description="Extracted facts dropped: their turn does not support them.")
    dropped: list[dict[str, str]] = Field(default_factory=list, description="Each dropped fact: text, turn_id, reason.")
    turns_stored_as_given: list[str] = Field(
        default_factory=list, description="Turns stored as the fact itself (as infer=false would): no grounded fact was left."
    )

    @classmethod
    def of(cls, turns: Sequence[TurnGrounding]) -> ExtractionReport:
        return cls(
            facts_extracted=sum(t.extracted for t in turns),
            facts_grounded=sum(len(t.kept) - t.stored_as_given for t in turns),
            facts_dropped=sum(len(t.dropped) for t in turns),
            dropped=[{"text": text, "turn_id": t.turn_id, "reason": why} for t in turns for text, why in t.dropped],
            turns_stored_as_given=[t.turn_id for t in turns if t.stored_as_given],
        )
