"""MemoryInterface: the memory's operations, declared once, as its shard serves them.

memory.shard.MemoryShard implements it (in its process, one call at a time: actors.shard_actor);
actors.shard_client.ShardClient offers the same operations to an LLM replica, asynchronously and
bounded in time, with the same names and parameters (tests/test_memory_interface.py checks both
against this declaration). One name per operation and per parameter from the replica to the store:
an add is prepare_add + commit_add (memory.add_plan), a search's size is `top_k` as a chat's is
(memory.chat_query), a fact's text is `text`. The HTTP edge keeps the wire names Mem0's and OpenAI's
clients send (`limit`, `memory`, ...) and maps them here (serve_app.ingress.routes,
serve_app.memory_protocol). Health probes are the actor's own (actors.shard_calls), not the memory's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:  # types only: this module imports no implementation
    from memory.add_plan import AddBatch, AddCommit, AddPlan, AddResult
    from memory.chat_query import ChatQuery
    from memory.kv_lifecycle import EncodeJob, EncodeOutcome
    from memory.planner import ChatPlan
    from memory.records import FactEvent, FactRecord, MemoryHit


class MemoryInterface(Protocol):
    """The operations of one shard's memory (module docstring). Every user-facing operation names
    its user; a fact of another user is UnknownFact, as a missing one is."""

    # ------------------------------------------------------------------ identity
    def arena_path(self) -> str:
        """Where the shard's KV arena lives (the engine's connector opens it)."""
        ...

    def ready(self) -> dict[str, Any]:
        """Identity and size: shard, facts, arena, pid, start phases."""
        ...

    def stats(self) -> dict[str, Any]:
        """Facts, KV bytes per tier, encode queue, Redis memory: GET /v1/shards."""
        ...

    # ------------------------------------------------------------------ writes
    def prepare_add(self, batch: AddBatch) -> AddPlan:
        """An add's checks and reconcile candidates (memory.add_plan)."""
        ...

    def commit_add(self, commit: AddCommit) -> AddResult:
        """An add's writes (memory.add_plan)."""
        ...

    def update(self, fact_id: str, user_id: str, text: str, metadata: dict[str, Any] | None = None) -> FactRecord:
        """New text (and metadata, when given) for a fact: a new version, its KV re-encoded."""
        ...

    def delete(self, fact_id: str, user_id: str) -> FactRecord:
        """Erase a fact (its history keeps the events without text)."""
        ...

    def delete_all(self, user_id: str) -> int:
        """Erase every fact and turn of the user; how many facts."""
        ...

    # ------------------------------------------------------------------ reads
    def get(self, fact_id: str, user_id: str) -> FactRecord:
        ...

    def get_all(self, user_id: str) -> list[FactRecord]:
        ...

    def history(self, fact_id: str, user_id: str) -> list[FactEvent]:
        ...

    def search(self, user_id: str, query: str, top_k: int) -> list[MemoryHit]:
        """The user's top_k facts for `query`, most relevant first."""
        ...

    def plan_chat(self, query: ChatQuery) -> ChatPlan:
        """The prompt of a chat with the user's memory (memory.chat_query, memory.planner)."""
        ...

    # ------------------------------------------------------------------ encoding (memory.kv_lifecycle)
    def take_encode_jobs(self, max_jobs: int | None = None, engine_slot: int | None = None) -> list[EncodeJob]:
        """Capture jobs for the engine in `engine_slot` (the client's own when None)."""
        ...

    def complete_encode_jobs(self, outcomes: dict[str, EncodeOutcome]) -> int:
        ...

    def encode_pending(self, fact_ids: Sequence[str]) -> list[str]:
        ...


OPERATIONS: tuple[str, ...] = tuple(
    name for name, value in vars(MemoryInterface).items() if callable(value) and not name.startswith("_")
)
"""The operations' names, in declaration order."""
