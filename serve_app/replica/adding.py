"""The replica's half of a memory add: what needs the engine, between the shard's two calls.

    limits (tokens: 400 before anything)   the replica
    extraction (served model, grounded)    the replica's engine (serve_app.replica.extraction)
    prepare_add(AddBatch) -> AddPlan       the shard: backlog and quotas (429), reconcile candidates
    decisions (served model, validated)    the replica's engine (serve_app.replica.reconciliation)
    commit_add(AddCommit) -> AddResult     the shard: turns, UPDATE / DELETE / NONE, new facts

Two shard round trips per add, whatever it holds (memory.add_plan; tests/test_add_round_trips.py
counts them). The answer is the typed AddResult with the extraction's report; the HTTP edge
makes Mem0's shape of it (serve_app.memory_protocol.add_answer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any, Callable

from memory.add_plan import AddBatch, AddCommit, AddResult
from memory.interface import MemoryInterface
from memory.prompting import PromptLayout
from memory.records import NewFact, Turn
from memory.settings import MemorySettings
from serve_app.memory_protocol import AddMemoryRequest
from serve_app.replica.extraction import extract_grounded
from serve_app.replica.limits import TokenLimits
from serve_app.replica.reconciliation import decide


class MemoryAdds:
    """Runs adds for one replica (module docstring): `engine()` is its current engine (replaced in
    place when its core dies), `shard` its shard client, `salt_of(user)` the user's prefix-cache scope."""

    def __init__(
        self, engine: Callable[[], Any], layout: PromptLayout, shard: Any, limits: TokenLimits, settings: MemorySettings,
        salt_of: Callable[[str], str],
    ) -> None:  # fmt: skip
        self.engine = engine
        self.layout = layout
        self.shard: MemoryInterface = shard  # async: actors.shard_client.ShardClient
        self.limits = limits
        self.settings = settings
        self.salt_of = salt_of

    async def add(self, request: AddMemoryRequest) -> AddResult:
        """Mem0 add: turns recorded, facts extracted (or taken as given), reconciled with the user's
        memory when asked, stored; the KV follows (the caller wakes the encoder)."""
        await asyncio.to_thread(self.limits.check_add, request)  # token bounds: a 400 before anything is stored
        user = request.user_id
        turns = [Turn(**t.model_dump(), order=i) for i, t in enumerate(request.turns or [])]
        if request.messages:
            base = uuid.uuid4().hex[:8]
            turns += [
                Turn(turn_id=f"m-{base}-{i}", speaker=m.role, text=m.content, order=len(turns) + i)
                for i, m in enumerate(request.messages)
            ]
        extracted: list[NewFact] = []
        extraction = None  # what the grounding check kept, dropped and stored as given (memory.grounding)
        if request.messages and request.infer:
            said = [t for t in turns if t.speaker == "user"]
            extracted, extraction = await extract_grounded(
                self.engine(), self.layout, said, self.settings.max_facts_per_turn, self.salt_of(user), fits=self.limits.fact_fits
            )
        elif request.messages:
            extracted = [NewFact(text=t.text, source_id=t.turn_id) for t in turns if t.speaker == "user"]
        # an extracted fact too long for an arena entry is dropped, not stored; the add's metadata goes with each fact
        extracted = [f.model_copy(update={"metadata": request.metadata}) for f in self.limits.fitting(extracted)]
        source = request.source_id or (turns[-1].turn_id if turns else None)
        given = [NewFact(text=text, source_id=source, metadata=request.metadata) for text in request.facts or []]
        reconcile = bool(request.messages and request.infer and (self.settings.reconcile if request.reconcile is None else request.reconcile))
        batch = AddBatch(user_id=user, turns=turns, extracted=extracted, given=given, reconcile=reconcile)
        plan = await self.shard.prepare_add(batch)  # 429 here (quota, backlog) before the engine decides anything
        decisions = None
        if reconcile and extracted:  # ADD / UPDATE / DELETE / NONE against the user's closest facts
            decided = await decide(
                self.engine(), self.layout, extracted, plan.candidates,
                min_score=self.settings.reconcile_min_score, fits=self.limits.fact_fits, cache_salt=self.salt_of(user),
            )  # fmt: skip
            decisions = [d.message() for d in decided]
        result = await self.shard.commit_add(AddCommit(batch=batch, decisions=decisions))
        return dataclasses.replace(result, extraction=extraction)
