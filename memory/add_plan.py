"""AddBatch, AddPlan, AddCommit, AddResult: what a memory add carries between the replica and its shard.

An add crosses into the shard twice, whatever it holds (the chat's ChatQuery -> ChatPlan, for
writes): the replica extracts facts with the engine, then
1. `prepare_add(AddBatch)` -> AddPlan: the shard checks the user's encode backlog and quotas for
   the whole batch and finds every extracted fact's reconcile candidates (the user's closest
   facts), under its lock;
2. the replica's model decides ADD / UPDATE / DELETE / NONE per extracted fact (the engine's work);
3. `commit_add(AddCommit)` -> AddResult: the shard checks backlog and quotas again and, under the
   same lock, places the turns after the user's last one and writes them, applies the decisions
   and adds the new facts, so the check and the writes cannot disagree.
Plain frozen dataclasses over memory.records' models: no Ray, vLLM or Redis types, pickled between
processes as they are. Mem0's wire shape (`id`, `memory`, `previous_memory`) is made at the HTTP
edge (serve_app.memory_protocol.add_answer), not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Sequence

from memory.records import MemoryHit, NewFact, Turn

if TYPE_CHECKING:  # a type only: the report is the replica's, made by memory.grounding
    from memory.grounding import ExtractionReport

AddEvent = Literal["ADD", "UPDATE", "DELETE", "NONE"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AddBatch:
    """What one add stores: its turns, the facts the model extracted and the facts given as they are."""

    user_id: str
    turns: Sequence[Turn] = ()  # `order` counts within this add (0, 1, ...); the shard places them after the user's last turn
    extracted: Sequence[NewFact] = ()  # reconciled with the user's memory when `reconcile`, else added
    given: Sequence[NewFact] = ()  # added as they are, never reconciled
    reconcile: bool = False

    @property
    def new_facts(self) -> list[NewFact]:
        """Every fact this add could store (what its quota and backlog checks count)."""
        return [*self.extracted, *self.given]


@dataclass(frozen=True, slots=True, kw_only=True)
class AddPlan:
    """The shard's answer to prepare_add: the room is there (else it raised QuotaExceeded or
    EncodeBacklogFull) and, per extracted fact of a reconciled add, its candidates: the user's
    closest facts at least memory.reconcile_min_score similar, most similar first."""

    candidates: tuple[tuple[MemoryHit, ...], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class FactDecision:
    """The model's validated decision about one extracted fact (serve_app.replica.reconciliation).
    ADD stores `fact`; UPDATE writes `text` into `target_id`; DELETE removes `target_id` and stores
    `fact`; NONE stores nothing. A target gone meanwhile: UPDATE falls back to ADD, DELETE only adds."""

    event: AddEvent
    fact: NewFact
    target_id: str | None = None
    target_text: str | None = None  # the target as the model saw it (an UPDATE's previous text)
    text: str | None = None  # UPDATE: the target's new text


@dataclass(frozen=True, slots=True, kw_only=True)
class AddCommit:
    """The writes of an add: its batch, and one decision per extracted fact when it was reconciled
    (None: every extracted fact is added)."""

    batch: AddBatch
    decisions: Sequence[FactDecision] | None = None

    def resolved(self) -> list[FactDecision]:
        """One decision per extracted fact (ADD for each when none were given), then ADD for each given fact."""
        extracted = list(self.decisions) if self.decisions is not None else [FactDecision(event="ADD", fact=f) for f in self.batch.extracted]
        return extracted + [FactDecision(event="ADD", fact=f) for f in self.batch.given]


@dataclass(frozen=True, slots=True, kw_only=True)
class FactOutcome:
    """What an add did to one fact. ADD: stored (or NONE: the same text from the same source was
    stored already); UPDATE: `fact_id` now holds `text`, it held `previous_text`; DELETE: `fact_id`
    (which held `text`) is gone; NONE: the memory holds it already."""

    event: AddEvent
    fact_id: str
    text: str
    previous_text: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AddResult:
    """The shard's answer to commit_add (and, with the replica's extraction report, the add's)."""

    outcomes: tuple[FactOutcome, ...] = ()
    extraction: ExtractionReport | None = field(default=None)  # the replica's (memory.grounding), when it extracted

    @property
    def live_fact_ids(self) -> list[str]:
        """The facts this add leaves in memory (whose KV an add may wait for)."""
        return [o.fact_id for o in self.outcomes if o.event != "DELETE"]
