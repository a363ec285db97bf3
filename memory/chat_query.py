"""ChatQuery: what a chat asks of its user's memory, one frozen object from HTTP to the shard.

The replica builds it from the request (serve_app.protocol.ChatCompletionRequest.memory_query),
the shard client sends it over the plan channel or Ray (actors.shard_client), and the shard
selects facts for it (memory.fact_selection) and plans the prompt (memory.planner). It carries
no Ray, vLLM or Redis types: it is pickled between processes as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence, get_args

MemoryMode = Literal["kv", "prompt", "none", "full"]
"""kv: inject the facts' stored KV; prompt: prefill the same facts as text (Mem0-style); none: no
memory; full: every fact of the user as text, oldest first, no retrieval."""

MEMORY_MODES: frozenset[str] = frozenset(get_args(MemoryMode))


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatQuery:
    """One chat's request to its user's memory shard (see the module docstring)."""

    user_id: str
    messages: Sequence[Mapping[str, str]]  # {"role", "content"} as the chat template takes them
    mode: MemoryMode = "kv"
    top_k: int | None = None  # facts to retrieve; None: the shard's memory.top_k
    max_prompt_tokens: int | None = None  # the least relevant facts are left out until the prompt fits
    prefill_top_m: int | None = None  # mode kv: the m most relevant facts prefilled as text; None: memory.prefill_top_m

    def __post_init__(self) -> None:
        if self.mode not in MEMORY_MODES:
            raise ValueError(f"memory mode {self.mode!r} is not one of {sorted(MEMORY_MODES)}")
        for name in ("top_k", "max_prompt_tokens", "prefill_top_m"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")

    @property
    def question(self) -> str:
        """The last user message: what facts are retrieved for ("" when there is none)."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")
