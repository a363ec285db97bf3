"""Prompt layout (SmolLM2's chat template) and extraction parsing; no engine."""

from __future__ import annotations

import pytest

from serve_app.replica.extraction import parse_facts
from memory.records import Turn
from memory.prompting import PromptLayout, extraction_schema


@pytest.fixture(scope="module")
def layout(smollm2_dir) -> PromptLayout:
    from transformers import AutoTokenizer

    return PromptLayout(AutoTokenizer.from_pretrained(smollm2_dir))


def test_served_prompt_is_the_chat_template_with_the_facts_in_the_system_message(layout: PromptLayout) -> None:
    facts = ["Ann has a cat.", "Ann lives in Oslo."]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where do I live?"}]
    ids = layout.prefix_ids + [t for f in facts for t in layout.fact_ids(f)] + layout.suffix_ids(messages)
    memory = "".join(f"- {f}\n" for f in facts)
    expected = layout.tokenizer.apply_chat_template(
        [{"role": "system", "content": layout.instruction + memory + "\nBe brief."}, messages[1]],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert layout.tokenizer.decode(ids) == expected
    # the prefix does not depend on the conversation: it is captured once and injected
    assert layout.suffix_ids([{"role": "user", "content": "hi"}]) != layout.suffix_ids(messages)


@pytest.mark.parametrize("text", [
    "- Caroline went to the LGBTQ support group on 7 May 2023.\n",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",  # special tokens
    "  leading  spaces\t\ttabs\n\n", "émoji 🙂 ünïcode, \"quotes\" & 1,234.5", "",
])
def test_the_layouts_token_ids_are_the_tokenizers_own(layout: PromptLayout, text: str) -> None:
    """The layout calls the fast tokenizer's backend directly (planning-path cost): same ids."""
    assert layout._encode(text) == list(layout.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_encode_prompt_puts_the_window_between_prefix_and_fact(layout: PromptLayout) -> None:
    window = [Turn(turn_id="D1:1", speaker="Ann", text="I got a kitten!", order=0)]
    prompt = layout.encode_prompt("Ann has a cat.", window)
    assert prompt.token_ids[: len(layout.prefix_ids)] == layout.prefix_ids
    assert prompt.token_ids[prompt.start :] == layout.fact_ids("Ann has a cat.") and prompt.length == len(layout.fact_ids("Ann has a cat."))
    assert "Ann: I got a kitten!" in layout.tokenizer.decode(prompt.token_ids[len(layout.prefix_ids) : prompt.start])
    assert layout.encode_prompt("Ann has a cat.", []).start == len(layout.prefix_ids)


def test_extraction_answers_are_parsed_and_capped() -> None:
    assert extraction_schema(5)["properties"]["facts"]["maxItems"] == 5
    assert parse_facts('{"facts": ["A likes tea.", " A likes tea. ", "", "B runs."]}', 5) == ["A likes tea.", "B runs."]
    assert parse_facts('{"facts": ["1", "2", "3", "4", "5", "6"]}', 5) == ["1", "2", "3", "4", "5"]
    assert parse_facts('{"facts": ["cut off', 5) == []  # truncated at max_tokens
    assert parse_facts('["not", "an object"]', 5) == []
    assert parse_facts('{"facts": [1, null, "ok"]}', 5) == ["ok"]


def test_locomo_fact_sources_become_one_dialogue_id() -> None:
    from bench.ingest.ingest_locomo import observation_facts

    sample = {
        "conversation": {"session_1_date_time": "8 May 2023", "session_2_date_time": "9 May 2023"},
        "observation": {
            "session_2_observation": {"B": [["Fact c.", "D2:7"]]},
            "session_1_observation": {"A": [["Fact a.", "D1:3; D1:4"], ["Fact b.", ["D1:9", "D1:2"]], ["Fact d.", []]]},
        },
    }
    facts = observation_facts(sample)
    assert [(f.text, f.source_id, f.session_time) for f in facts] == [
        ("Fact a.", "D1:3", "8 May 2023"),
        ("Fact b.", "D1:9", "8 May 2023"),
        ("Fact d.", None, "8 May 2023"),
        ("Fact c.", "D2:7", "9 May 2023"),
    ]


def test_window_bridge_and_memory_closing_go_where_the_settings_say(layout: PromptLayout) -> None:
    """memory.window_bridge: between a non-empty window and the fact (encode prompts only);
    memory.memory_closing: right after the facts, at the head of every suffix."""
    framed = PromptLayout(layout.tokenizer, layout.instruction, window_bridge="(end)\n", memory_closing="\nUse them.")
    window = [Turn(turn_id="D1:1", speaker="Ann", text="I got a kitten!", order=0)]
    prompt = framed.encode_prompt("Ann has a cat.", window)
    between = framed.tokenizer.decode(prompt.token_ids[len(framed.prefix_ids) : prompt.start])
    assert between.endswith("I got a kitten!\n(end)\n") and prompt.token_ids[prompt.start :] == framed.fact_ids("Ann has a cat.")
    assert framed.encode_prompt("Ann has a cat.", []).start == len(framed.prefix_ids)  # no window, no bridge
    assert framed.prefix_ids == layout.prefix_ids  # the injected prefix is unchanged
    messages = [{"role": "user", "content": "Where do I live?"}]
    assert framed.tokenizer.decode(framed.suffix_ids(messages)).startswith("\nUse them.")
    assert not layout.tokenizer.decode(layout.suffix_ids(messages)).startswith("\nUse them.")


def test_neighbours_sit_between_window_and_fact_and_are_dropped_before_the_fact(layout: PromptLayout) -> None:
    """memory.encode_neighbours: [prefix][window][neighbours][fact], least similar neighbour first;
    when the context is short, the window goes first, then the least similar neighbours."""
    window = [Turn(turn_id="D1:1", speaker="Ann", text="I got a kitten!", order=0)]
    neighbours = ["Ann lives in Oslo.", "Ann likes cats."]
    prompt = layout.encode_prompt("Ann has a cat.", window, neighbours=neighbours)
    fact = layout.fact_ids("Ann has a cat.")
    listed = layout.fact_ids(neighbours[0]) + layout.fact_ids(neighbours[1])
    assert prompt.token_ids[prompt.start - len(listed) : prompt.start] == listed
    assert prompt.token_ids[prompt.start :] == fact
    assert "Ann: I got a kitten!" in layout.tokenizer.decode(prompt.token_ids[len(layout.prefix_ids) : prompt.start - len(listed)])
    # room for the prefix, the fact and the closest neighbour only: no window, one neighbour
    tight = len(layout.prefix_ids) + len(fact) + len(layout.fact_ids(neighbours[1]))
    fitted = layout.encode_prompt("Ann has a cat.", window, max_tokens=tight, neighbours=neighbours)
    assert fitted.token_ids == layout.prefix_ids + layout.fact_ids(neighbours[1]) + fact
