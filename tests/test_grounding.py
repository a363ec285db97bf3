"""memory.grounding: extracted facts checked against the turn they came from (no engine).

The four sentences of issue 38 with what SmolLM2 (through mem0ai) stored for them: every invented
fact is refused and the faithful ones pass; a turn left without a fact that states something is
stored as it is; negation, numbers, stemming and the speaker's name are handled; the report adds up.
"""

from __future__ import annotations

import pytest

from memory.grounding import (
    ExtractionReport,
    GroundingSettings,
    ground_turn,
    grounding_check,
    states_something,
)
from memory.records import Turn

ISSUE_38 = {  # turn -> (facts the model invented (issue 38), faithful facts)
    "I just moved to Lisbon and I adopted a beagle called Pixel.": (
        ["Pixel", "São João", "São João de Lisbon", "São João de Portugal"],
        ["The user moved to Lisbon.", "The user adopted a beagle called Pixel."],
    ),
    "My favourite food is grilled sardines.": (
        ["The user likes salmon.", "The user likes shrimp.", "User enjoys lobster and scallops."],
        ["The user's favourite food is grilled sardines."],
    ),
    "I play the cello in an orchestra in Leeds.": (
        ["I'm a professional musician in the UK.", "The user is a professional musician in the UK."],
        ["The user plays the cello in an orchestra in Leeds."],
    ),
    "I am allergic to peanuts.": (["The user is allergic to tree nuts."], ["The user is allergic to peanuts."]),
}


@pytest.mark.parametrize("turn", list(ISSUE_38))
def test_invented_facts_are_refused_and_faithful_ones_kept(turn: str) -> None:
    invented, faithful = ISSUE_38[turn]
    for fact in invented:
        verdict = grounding_check(fact, turn, "user")
        assert not verdict.grounded, fact
        assert verdict.reason
    for fact in faithful:
        assert grounding_check(fact, turn, "user").grounded, fact


def test_missing_words_are_named() -> None:
    verdict = grounding_check("The user is a professional musician in the UK.", "I play the cello in Leeds.", "user")
    assert verdict.missing == ("professional", "musician", "uk")
    assert "professional" in verdict.reason


def test_negation_numbers_stems_and_names() -> None:
    assert not grounding_check("The user is allergic to peanuts.", "I am not allergic to peanuts.", "user").grounded
    assert not grounding_check("The user is allergic to peanuts.", "I'm not allergic to peanuts at all", "user").grounded
    assert grounding_check("The user is not allergic to peanuts.", "I am not allergic to peanuts.", "user").grounded
    assert grounding_check("Caroline has two kids.", "I have 2 kids!", "Caroline").grounded
    assert not grounding_check("Caroline has three kids.", "I have 2 kids!", "Caroline").grounded
    assert grounding_check("Melanie painted a lake sunrise.", "I'm painting a sunrise over the lake", "Melanie").grounded
    # the speaker's name may be in the fact without being in the turn; another name may not
    assert grounding_check("Jon visited Rome recently.", "I visited Rome recently", "Jon").grounded
    assert not grounding_check("Gina visited Rome recently.", "I visited Rome recently", "Jon").grounded


def test_tolerance_setting() -> None:
    loose = GroundingSettings(max_missing=1)
    assert grounding_check("The user attended a support group.", "I went to a support group.", "user", loose).grounded
    assert not grounding_check("The user attended a support group.", "I went to a support group.", "user").grounded


def test_states_something() -> None:
    assert states_something("I am allergic to peanuts.")
    assert states_something("Thanks! My goal is to give kids a loving home.")
    assert not states_something("Hey Mel! Good to see you! How have you been?")
    assert not states_something("Wow, that agency looks great! What made you pick it?")
    assert not states_something("Do I like tea?")
    assert not states_something("")


def _turn(text: str, turn_id: str = "m-1") -> Turn:
    return Turn(turn_id=turn_id, speaker="user", text=text, order=0)


def test_turn_kept_as_given_when_nothing_grounded_is_left() -> None:
    allergy = ground_turn(_turn("I am allergic to peanuts."), [])  # the model said nothing (issue 38)
    assert allergy.stored_as_given and [f.text for f in allergy.kept] == ["I am allergic to peanuts."]
    assert allergy.kept[0].source_id == "m-1"
    lisbon = ground_turn(_turn("I just moved to Lisbon and I adopted a beagle called Pixel."), ISSUE_38[
        "I just moved to Lisbon and I adopted a beagle called Pixel."][0])  # fmt: skip
    assert lisbon.stored_as_given and len(lisbon.dropped) == 4
    assert [f.text for f in lisbon.kept] == ["I just moved to Lisbon and I adopted a beagle called Pixel."]
    sardines = ground_turn(_turn("My favourite food is grilled sardines."),
                           ["The user's favourite food is grilled sardines.", "The user likes salmon."])  # fmt: skip
    assert not sardines.stored_as_given
    assert [f.text for f in sardines.kept] == ["The user's favourite food is grilled sardines."]
    assert sardines.dropped[0][0] == "The user likes salmon."
    greeting = ground_turn(_turn("Hey! How are you?"), ["The user is happy."])
    assert greeting.kept == [] and not greeting.stored_as_given
    too_long = ground_turn(_turn("I am allergic to peanuts."), [], fits=lambda text: False)
    assert too_long.kept == [] and not too_long.stored_as_given
    off = ground_turn(_turn("I am allergic to peanuts."), ["The user likes salmon."], GroundingSettings(enabled=False))
    assert [f.text for f in off.kept] == ["The user likes salmon."] and not off.dropped


def test_report_adds_up() -> None:
    turns = [
        ground_turn(_turn("I am allergic to peanuts.", "a"), []),
        ground_turn(_turn("My favourite food is grilled sardines.", "b"),
                    ["The user's favourite food is grilled sardines.", "The user likes salmon."]),  # fmt: skip
    ]
    report = ExtractionReport.of(turns)
    assert (report.facts_extracted, report.facts_grounded, report.facts_dropped) == (2, 1, 1)
    assert report.turns_stored_as_given == ["a"]
    assert report.dropped == [{"text": "The user likes salmon.", "turn_id": "b", "reason": "words not in the turn: likes, salmon"}]
