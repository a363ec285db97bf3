"""The shard's half of a memory add: prepare (checks and reconcile candidates) and commit (every write).

memory.shard.MemoryShard.prepare_add and .commit_add run these under the shard's lock (a Ray
actor's calls run one at a time: actors.shard_actor); the messages are memory.add_plan's.

- prepare: the user's encode backlog (memory.fairness) and quotas (memory.quota) for the whole
  batch, so an add that cannot be stored is refused (429) before the engine decides anything;
  then, for a reconciled add, every extracted fact's closest facts of this user (the shard's own
  search), those at least memory.reconcile_min_score similar: all taken before any change, so
  every fact of the add is decided against the same memory.
- commit: the same checks again over what the decisions store (the memory may have changed
  between the two calls), then, with nothing else of the shard running in between, the turns
  placed after the user's last one, the UPDATEs, DELETEs and the new facts (one embedding batch).
  Each Redis write checks the quota once more in its own transaction (memory.fact_store).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from memory.add_plan import AddBatch, AddCommit, AddPlan, AddResult, FactDecision, FactOutcome
from memory.fairness import EncodeBacklogFull
from memory.records import FactRecord, NewFact, Turn, UnknownFact


class MemoryShard(Protocol):
    """What an add uses of memory.shard.MemoryShard (named here, not imported: the shard imports this)."""

    shard_id: int
    settings: Any  # memory.settings.MemorySettings
    store: Any  # memory.fact_store.FactStore
    kv: Any  # memory.kv_lifecycle.FactKVLifecycle
    facts: dict[str, Any]
    selector: Any  # memory.fact_selection.FactSelector
    embedder: Any  # memory.embedder.Embedder
    read_repair: Any  # memory.read_repair.ReadRepair

    def track_version(self, record: FactRecord, vector: Any) -> None: ...

    def update(self, fact_id: str, user_id: str, text: str, metadata: dict[str, Any] | None = None) -> FactRecord: ...

    def delete(self, fact_id: str, user_id: str) -> FactRecord: ...


def check_encode_backlog(shard: MemoryShard, user_id: str, new_facts: int) -> None:
    """EncodeBacklogFull (429) when `new_facts` more would put the user past
    max_pending_encodes_per_user facts waiting for their KV (memory.fairness)."""
    bound = shard.settings.max_pending_encodes_per_user
    if bound and (pending := shard.kv.pending(user_id)) + new_facts > bound:
        raise EncodeBacklogFull(
            f"user {user_id!r} has {pending} facts waiting for their KV; {new_facts} more would pass the bound of "
            f"{bound} (memory.max_pending_encodes_per_user): retry after the backlog drains"
        )


def placed_turns(shard: MemoryShard, user_id: str, turns: Sequence[Turn]) -> list[Turn]:
    """The add's turns after the user's last recorded one, in the add's order."""
    if not turns:
        return []
    start = shard.store.last_turn_order(user_id) + 1.0
    return [t.model_copy(update={"order": start + t.order}) for t in turns]


def check_room(shard: MemoryShard, user_id: str, facts: Sequence[NewFact], turns: Sequence[Turn]) -> None:
    """Backlog, then quotas, for `facts` and `turns` together (a turns-only add counts one fact
    against the backlog: its turns' facts come later)."""
    if turns or facts:
        check_encode_backlog(shard, user_id, max(1, len(facts)) if turns else len(facts))
        shard.store.check_room(user_id, list(facts), list(turns))


def prepare(shard: MemoryShard, batch: AddBatch) -> AddPlan:
    """See the module docstring."""
    user = batch.user_id
    shard.read_repair.repair(user)
    check_room(shard, user, batch.new_facts, placed_turns(shard, user, batch.turns))
    if not (batch.reconcile and batch.extracted):
        return AddPlan()
    settings = shard.settings
    candidates = []
    for fact in batch.extracted:
        hits = shard.selector.search(user, fact.text, settings.reconcile_top_k) if settings.reconcile_top_k > 0 else []
        candidates.append(tuple(h for h in hits if h.score >= settings.reconcile_min_score))
    return AddPlan(candidates=tuple(candidates))


def commit(shard: MemoryShard, add: AddCommit) -> AddResult:
    """See the module docstring."""
    batch = add.batch
    user = batch.user_id
    decisions = add.resolved()
    stored = [d.fact for d in decisions if d.event in ("ADD", "DELETE")]  # (an UPDATE whose target is gone adds too)
    shard.read_repair.repair(user)
    turns = placed_turns(shard, user, batch.turns)
    check_room(shard, user, stored, turns)
    with shard.read_repair.writing(user):
        shard.store.claim_user(user, shard.shard_id)
        if turns:
            shard.store.add_turns(user, turns)
    outcomes: list[FactOutcome] = []
    adds: list[NewFact] = []
    for decision in decisions:
        outcomes += apply(shard, user, decision, adds)
    return AddResult(outcomes=tuple(outcomes) + tuple(add_facts(shard, user, adds)))


def apply(shard: MemoryShard, user_id: str, decision: FactDecision, adds: list[NewFact]) -> list[FactOutcome]:
    """The outcome of an UPDATE, DELETE or NONE (the shard's update and delete check the owner:
    only this user's facts can be changed); the facts to store go on `adds`."""
    target = decision.target_id
    if decision.event == "UPDATE" and target is not None:
        try:
            record = shard.update(target, user_id, decision.text or decision.fact.text)
        except UnknownFact:  # gone meanwhile, or not this user's: the new fact is added instead
            adds.append(decision.fact)
            return []
        return [FactOutcome(event="UPDATE", fact_id=record.fact_id, text=record.text, previous_text=decision.target_text)]
    if decision.event == "DELETE" and target is not None:
        adds.append(decision.fact)  # unlike Mem0, the new fact is kept: it is what the user just said
        try:
            record = shard.delete(target, user_id)
        except UnknownFact:
            return []
        return [FactOutcome(event="DELETE", fact_id=target, text=decision.target_text or record.text)]
    if decision.event == "NONE" and target is not None:
        return [FactOutcome(event="NONE", fact_id=target, text=decision.target_text or "")]
    adds.append(decision.fact)
    return []


def add_facts(shard: MemoryShard, user_id: str, facts: Sequence[NewFact]) -> list[FactOutcome]:
    """Store, embed and index facts, and queue their encoding: ADD per fact, or NONE when the same
    text from the same source was stored already (a retried add makes no duplicates)."""
    if not facts:
        return []
    embeddings = shard.embedder.embed([f.text for f in facts])
    outcomes = []
    with shard.read_repair.writing(user_id):
        shard.store.claim_user(user_id, shard.shard_id)
        for fact, embedding in zip(facts, embeddings):
            record, created = shard.store.add(user_id, fact, embedding)
            if created or record.fact_id not in shard.facts:
                shard.track_version(record, embedding)
            outcomes.append(FactOutcome(event="ADD" if created else "NONE", fact_id=record.fact_id, text=record.text))
    return outcomes
