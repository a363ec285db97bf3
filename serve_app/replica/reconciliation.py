"""Reconciling extracted facts with the user's memory on add (Mem0's update phase).

For every fact extracted from a message, the user's closest existing facts are retrieved (the
shard's prepare_add, user-filtered); those at least memory.reconcile_min_score similar to it are shown
to the served model under short integer aliases ("0", "1", ...; never the real ids), and a fact
with none is added without asking. The model answers one decision per new fact, JSON-guided
by a schema (vLLM structured outputs, greedy):

    {"event": "ADD" | "UPDATE" | "DELETE" | "NONE", "id": <alias>, "text": <updated memory>}

ADD stores the new fact; UPDATE replaces the aliased fact's text (a new version: history event
UPDATE, its KV re-encoded); DELETE removes the aliased fact (history event DELETE) and stores the
new fact (unlike Mem0, see memory.adding.apply); NONE stores nothing (the memory already holds it).

Every decision is validated before anything is applied (`parse_decision`): an answer that is not
the schema's JSON, an alias that was not shown, a target less similar to the new fact than
memory.reconcile_min_score, or a second change of a fact another decision already changes falls
back to ADD; an UPDATE's text must be grounded in the two facts (else the new fact's text is
written); a fact text already in memory is NONE. Only facts the search returned for this user
can be named, and the shard's commit_add checks the owner again (memory.adding). The pieces
without the engine (schema, prompt, parsing, aliasing, validation) are plain functions; `decide`
runs them around the engine, on the candidates the shard's prepare_add found
(serve_app.replica.adding: the replica's add).

What SmolLM2-135M-Instruct decides here: docs/memory.md, "Reconciliation".
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from memory.add_plan import AddEvent as Event
from memory.add_plan import FactDecision
from memory.records import MemoryHit, NewFact
from serve_app.replica.scheduling import MEMORY_WRITE_PRIORITY

logger = logging.getLogger(__name__)

EVENTS: tuple[Event, ...] = ("ADD", "UPDATE", "DELETE", "NONE")

RECONCILE_INSTRUCTION = (
    "You keep a memory of facts about the user. You get the memory (numbered facts) and one new fact. "
    "Decide what to do with the new fact:\n"
    "- ADD: the new fact is new information, unrelated to every memory.\n"
    "- UPDATE: the new fact changes or replaces a memory (the user moved, changed job, changed a preference). "
    "Give its id and the updated memory text.\n"
    "- DELETE: the new fact says a memory is no longer true, without replacing it. Give its id.\n"
    "- NONE: a memory already says the same thing. Give its id.\n"
    'Answer in JSON: {"event": "ADD" | "UPDATE" | "DELETE" | "NONE", "id": <memory id, or -1 for ADD>, '
    '"text": "<the updated memory for UPDATE, else empty>"}.'
)

# worked examples, as earlier conversation turns. SmolLM2-135M copies the pattern of the examples
# whatever the facts (docs/memory.md, "Reconciliation"); the validation below bounds what it can change.
FEW_SHOT: tuple[tuple[list[str], str, dict[str, Any]], ...] = (
    (["Anna works as a teacher.", "Anna has a dog."], "Anna now works as a lawyer.",
     {"event": "UPDATE", "id": 0, "text": "Anna now works as a lawyer."}),
    (["Tom likes jazz."], "Tom plays tennis on Sundays.", {"event": "ADD", "id": -1, "text": ""}),
    (["Lee lives in Oslo.", "Lee has two kids."], "Lee moved to Madrid.",
     {"event": "UPDATE", "id": 0, "text": "Lee lives in Madrid."}),
    (["Kim drinks tea."], "Kim has a brother called Joe.", {"event": "ADD", "id": -1, "text": ""}),
)  # fmt: skip


@dataclass(frozen=True)
class Candidate:
    """An existing fact of the user shown to the model under `alias`."""

    alias: int
    fact_id: str
    text: str
    score: float


@dataclass(frozen=True)
class Decision:
    """What to do with one extracted fact, validated (`target` is one of this user's candidates)."""

    event: Event
    fact: NewFact
    target: Candidate | None = None
    text: str | None = None  # UPDATE: the new text of target
    note: str | None = None  # why the model's proposal was not taken as it was
    raw: str | None = None  # the model's answer, as generated

    def message(self) -> FactDecision:
        """The decision as the shard's commit_add takes it (memory.add_plan)."""
        target = self.target
        return FactDecision(
            event=self.event, fact=self.fact, text=self.text,
            target_id=target.fact_id if target is not None else None, target_text=target.text if target is not None else None,
        )  # fmt: skip


def alias_candidates(hits: Sequence[MemoryHit]) -> list[Candidate]:
    """The retrieved facts under aliases 0..n-1 (most similar first), each fact once."""
    seen: set[str] = set()
    out: list[Candidate] = []
    for hit in hits:
        if hit.fact_id not in seen:
            seen.add(hit.fact_id)
            out.append(Candidate(len(out), hit.fact_id, hit.text, hit.score))
    return out


def decision_schema(num_candidates: int) -> dict[str, Any]:
    """JSON schema of one decision; `id` is bounded to the aliases shown (-1: none)."""
    return {
        "type": "object",
        "properties": {
            "event": {"type": "string", "enum": list(EVENTS)},
            "id": {"type": "integer", "minimum": -1, "maximum": max(num_candidates - 1, -1)},
            "text": {"type": "string", "maxLength": 300},
        },
        "required": ["event", "id", "text"],
        "additionalProperties": False,
    }


def _user_message(memories: Sequence[str], fact: str) -> str:
    listed = "\n".join(f"{i}: {text}" for i, text in enumerate(memories)) or "(empty)"
    return f"Memory:\n{listed}\n\nNew fact: {fact}"


def decision_messages(fact_text: str, candidates: Sequence[Candidate]) -> list[dict[str, str]]:
    """The chat messages of one decision: instruction, worked examples, then this fact."""
    messages = [{"role": "system", "content": RECONCILE_INSTRUCTION}]
    for memories, new, answer in FEW_SHOT:
        messages.append({"role": "user", "content": _user_message(memories, new)})
        messages.append({"role": "assistant", "content": json.dumps(answer)})
    messages.append({"role": "user", "content": _user_message([c.text for c in candidates], fact_text)})
    return messages


def _norm(text: str) -> str:
    return " ".join(_words(text))


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def update_text(proposed: Any, fact: NewFact, target: Candidate, fits: Callable[[str], bool]) -> str:
    """The text an UPDATE writes: the model's merge of the old and the new fact when it is grounded
    (fits a memory entry, uses only words of the two facts and at least one word the new fact
    brings), else the new fact's own text."""
    text = proposed.strip() if isinstance(proposed, str) else ""
    words, new, old = set(_words(text)), set(_words(fact.text)), set(_words(target.text))
    if text and fits(text) and words <= new | old and words & (new - old):
        return text
    return fact.text


def parse_decision(
    raw: str,
    fact: NewFact,
    candidates: Sequence[Candidate],
    *,
    min_score: float = 0.0,
    fits: Callable[[str], bool] = lambda text: True,
) -> Decision:
    """The validated decision for `fact` from the model's answer `raw`.

    A fact whose text is already in memory is NONE whatever the model said. Fallbacks to ADD
    (each logged): not JSON, not an object, no valid event; UPDATE, DELETE or NONE naming an alias
    that was not shown; a target less similar to the new fact than `min_score` (the model may only
    change a fact the new one is about). UPDATE's text: `update_text`."""
    same = next((c for c in candidates if _norm(c.text) == _norm(fact.text)), None)
    if same is not None:
        return Decision("NONE", fact, same, raw=raw, note="the memory holds this text already")

    def add(note: str) -> Decision:
        logger.info("reconcile: %s; ADD %r (model said %.120r)", note, fact.text, raw)
        return Decision("ADD", fact, raw=raw, note=note)

    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        return add("answer is not JSON")
    if not isinstance(payload, dict) or payload.get("event") not in EVENTS:
        return add("answer has no valid event")
    event: Event = payload["event"]
    if event == "ADD":
        return Decision("ADD", fact, raw=raw)
    alias = payload.get("id")
    by_alias = {c.alias: c for c in candidates}
    target = by_alias.get(alias) if isinstance(alias, int) and not isinstance(alias, bool) else None
    if target is None:
        return add(f"{event} names unknown memory id {alias!r}")
    if target.score < min_score:
        return add(f"{event} of memory {alias} ({target.score:.2f} similar, below {min_score:.2f})")
    if event != "UPDATE":
        return Decision(event, fact, target, raw=raw)
    return Decision("UPDATE", fact, target, update_text(payload.get("text"), fact, target, fits), raw=raw)


def one_decision_per_target(decisions: Sequence[Decision]) -> list[Decision]:
    """At most one decision changes an existing fact: when several UPDATE/DELETE the same fact, the
    new fact most similar to it keeps the change (the first on a tie) and the others become ADDs
    (NONE stays: it changes nothing). The order of `decisions` is kept."""
    winner: dict[str, int] = {}
    for i, d in enumerate(decisions):
        if d.event in ("UPDATE", "DELETE") and d.target is not None:
            best = winner.get(d.target.fact_id)
            if best is None or d.target.score > decisions[best].target.score:  # type: ignore[union-attr]
                winner[d.target.fact_id] = i
    out: list[Decision] = []
    for i, d in enumerate(decisions):
        if d.event in ("UPDATE", "DELETE") and d.target is not None and winner[d.target.fact_id] != i:
            logger.info("reconcile: memory %s is changed by another fact of this add; ADD %r", d.target.fact_id, d.fact.text)
            d = Decision("ADD", d.fact, raw=d.raw, note="target changed by another fact of this add")
        out.append(d)
    return out


def decision_params(num_candidates: int, max_tokens: int = 160):
    """Greedy decoding under the decision schema (vLLM structured outputs)."""
    from vllm import SamplingParams  # vLLM: not in `serve run`'s driver
    from vllm.sampling_params import StructuredOutputsParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=decision_schema(num_candidates)),
    )


async def decide(
    engine: Any,
    layout: Any,
    facts: Sequence[NewFact],
    candidates: Sequence[Sequence[MemoryHit]],
    *,
    min_score: float,
    fits: Callable[[str], bool],
    cache_salt: str | None = None,
) -> list[Decision]:
    """One validated decision per extracted fact. `candidates[i]` are the user's closest facts to
    `facts[i]` (MemoryHit, user-filtered: the shard's AddPlan, all found before any change, so every
    fact sees the same memory); those at least `min_score` similar are shown to the model, and a
    fact with none is an ADD without asking. The facts are decided concurrently."""
    from vllm.inputs import TokensPrompt  # vLLM: not in `serve run`'s driver

    async def one(fact: NewFact, hits: Sequence[MemoryHit]) -> Decision:
        shown = alias_candidates([h for h in hits if h.score >= min_score])  # only related facts can be named
        if not shown:
            return Decision("ADD", fact, note="no related memory")
        messages = decision_messages(fact.text, shown)
        prompt = TokensPrompt(prompt_token_ids=await asyncio.to_thread(layout.plain_prompt_ids, messages))
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        final = None
        params = decision_params(len(shown))
        async for output in engine.generate(prompt, params, request_id=f"reconcile-{uuid.uuid4().hex}", priority=MEMORY_WRITE_PRIORITY):
            final = output
        raw = final.outputs[0].text if final is not None else ""
        decision = parse_decision(raw, fact, shown, min_score=min_score, fits=fits)
        logger.info("reconcile %r against %s: %s -> %s", fact.text, [c.text for c in shown], raw, decision.event)
        return decision

    if len(candidates) != len(facts):
        raise ValueError(f"{len(facts)} facts but candidates for {len(candidates)}")
    decisions = await asyncio.gather(*(one(f, h) for f, h in zip(facts, candidates)))
    return one_decision_per_target(decisions)
