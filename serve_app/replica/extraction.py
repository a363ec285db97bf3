"""Fact extraction by the served model itself, JSON-guided (vLLM structured outputs).

For each turn the model answers {"facts": [...]} under a JSON schema that caps the list at
max_facts_per_turn, so the output always parses; facts are stripped, de-duplicated and capped
again (defence against a backend that ignores maxItems).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, Sequence

from memory.records import NewFact, Turn
from memory.prompting import PromptLayout, extraction_schema
from serve_app.replica.scheduling import MEMORY_WRITE_PRIORITY

logger = logging.getLogger(__name__)


def extraction_params(max_facts: int, max_tokens: int = 256):
    from vllm import SamplingParams
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
    """Facts from every turn (concurrently), each tagged with its source turn."""
    from vllm.inputs import TokensPrompt

    params = extraction_params(max_facts)

    async def one(turn: Turn) -> list[NewFact]:
        prompt = TokensPrompt(prompt_token_ids=layout.extraction_prompt_ids(turn.speaker, turn.text, max_facts))
        if cache_salt:  # the user's own prefix-cache scope (memory.composition.user_salt)
            prompt["cache_salt"] = cache_salt
        final = None
        async for output in engine.generate(prompt, params, request_id=f"extract-{uuid.uuid4().hex}", priority=MEMORY_WRITE_PRIORITY):
            final = output
        text = final.outputs[0].text if final is not None else ""
        return [NewFact(text=f, source_id=turn.turn_id, session_time=turn.session_time) for f in parse_facts(text, max_facts)]

    per_turn = await asyncio.gather(*(one(t) for t in turns))
    return [fact for facts in per_turn for fact in facts]
