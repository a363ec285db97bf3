"""Fact extraction by the served model itself, JSON-guided (vLLM structured outputs).

For each turn the model answers {"facts": [...]} under a JSON schema that caps the list at
max_facts_per_turn, so the output always parses; facts are stripped, de-duplicated and capped
again (defence against a backend that ignores maxItems). `extract_grounded` (what an add runs)
checks every fact against the turn it came from (memory.grounding): a fact the turn does not
support is dropped and counted, and a user turn that states something but keeps no fact is
stored as it is; its `ExtractionReport` goes into the add's answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, Callable, Sequence

from memory.grounding import ExtractionReport, GroundingSettings, ground_turn
from memory.records import NewFact, Turn
from memory.prompting import PromptLayout, extraction_schema
from serve_app.replica.scheduling import MEMORY_WRITE_PRIORITY

logger = logging.getLogger(__name__)


def extraction_params(max_facts: int, max_tokens: int = 256):
    from vllm import SamplingParams  # vLLM: not in `serve run`'s driver
    from vllm.sampling_params import StructuredOutputsParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=extraction_schema(max_facts)),
    )


def parse_facts(text: str, max_facts: int) -> list[str]:
    """The facts of one extraction answer; [] when it is not the JSON the schema asks for."""
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        logger.warning("extraction answer is not JSON (truncated?): %.80r", text)
        return []
    facts = payload.get("facts", []) if isinstance(payload, dict) else []
    out: list[str] = []
    for fact in facts:
        if isinstance(fact, str) and fact.strip() and fact.strip() not in out:
            out.append(fact.strip())
    return out[:max_facts]


async def extract_facts(
    engine: Any, layout: PromptLayout, turns: Sequence[Turn], max_facts: int, cache_salt: str | None = None
) -> list[NewFact]:
    """Facts from every turn (concurrently), each tagged with its source turn, as the model says them."""
    per_turn = await extract_texts(engine, layout, turns, max_facts, cache_salt)
    return [NewFact(text=f, source_id=t.turn_id, session_time=t.session_time) for t, facts in zip(turns, per_turn) for f in facts]


async def extract_grounded(
    engine: Any, layout: PromptLayout, turns: Sequence[Turn], max_facts: int, cache_salt: str | None = None,
    grounding: GroundingSettings | None = None, fits: Callable[[str], bool] | None = None,
) -> tuple[list[NewFact], ExtractionReport]:
    """Facts from every turn that the turn supports (memory.grounding), or the turn itself where
    it states something and none is left; and the report of what was dropped and why."""
    per_turn = await extract_texts(engine, layout, turns, max_facts, cache_salt)
    checked = [ground_turn(t, facts, grounding, fits) for t, facts in zip(turns, per_turn)]
    return [f for c in checked for f in c.kept], ExtractionReport.of(checked)


async def extract_texts(
    engine: Any, layout: PromptLayout, turns: Sequence[Turn], max_facts: int, cache_salt: str | None = None
) -> list[list[str]]:
    """The model's facts of every turn (concurrently), one list per turn."""
    from vllm.inputs import TokensPrompt  # vLLM: not in `serve run`'s driver

    params = extraction_params(max_facts)

    async def one(turn: Turn) -> list[str]:
        prompt = TokensPrompt(prompt_token_ids=layout.extraction_prompt_ids(turn.speaker, turn.text, max_facts))
        if cache_salt:  # the user's own prefix-cache scope (memory.composition.user_salt)
            prompt["cache_salt"] = cache_salt
        final = None
        async for output in engine.generate(prompt, params, request_id=f"extract-{uuid.uuid4().hex}", priority=MEMORY_WRITE_PRIORITY):
            final = output
        text = final.outputs[0].text if final is not None else ""
        return parse_facts(text, max_facts)

    return list(await asyncio.gather(*(one(t) for t in turns)))
