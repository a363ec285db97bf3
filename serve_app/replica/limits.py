"""Token bounds the LLM replica enforces before anything is stored or generated (RequestRejected: 400).

The ingress bounds characters and counts (serve_app.protocol); only the replica has the
tokenizer, so the token bounds live here:

- a fact must fit one KV arena entry (memory.settings.ArenaCapacity: page_tokens x
  max_pages_per_entry, 256 tokens by default). A longer one could never get KV: it would be
  acknowledged and then prefilled as text on every request, so it is refused at the door;
- a message that facts are extracted from must leave its extraction prompt room in the context
  (a longer prompt would fail in the engine after the turn was recorded). Recorded turns need no
  token bound: a fact's encoding window is trimmed to the context (memory.prompting);
- a chat request's output: at most `max_output_tokens` (when set), and prompt + output within
  the context. Without max_tokens the output is the service default, lowered to the room left.
"""

from __future__ import annotations

import logging

from memory.records import NewFact
from memory.prompting import PromptLayout
from serve_app.memory_protocol import AddMemoryRequest
from serve_app.protocol import RequestRejected
from serve_app.settings import ServiceSettings

logger = logging.getLogger(__name__)


class TokenLimits:
    """See the module docstring; one per replica (its layout holds the tokenizer)."""

    def __init__(self, layout: PromptLayout, settings: ServiceSettings) -> None:
        self.layout = layout
        self.context = settings.engine.max_model_len
        arena = settings.memory.arena
        self.fact_tokens = arena.page_tokens * arena.max_pages_per_entry
        self.max_facts_per_turn = settings.memory.max_facts_per_turn
        self.max_output = settings.max_output_tokens
        self.default_output = min(settings.default_max_tokens, self.max_output or settings.default_max_tokens)
        if len(layout.prefix_ids) + self.fact_tokens >= self.context:
            raise ValueError(
                f"max_model_len={self.context} cannot hold the {len(layout.prefix_ids)}-token memory prefix and a "
                f"{self.fact_tokens}-token fact (an arena entry) plus one token: raise it or shrink the arena entries"
            )

    # ---------------------------------------------------------------- memory adds
    def fact_length(self, text: str) -> int:
        return len(self.layout.fact_ids(text))

    def fact_fits(self, text: str) -> bool:
        return self.fact_length(text) <= self.fact_tokens

    def check_fact(self, text: str, param: str) -> None:
        n = self.fact_length(text)
        if n > self.fact_tokens:
            raise RequestRejected(
                f"{param}: a fact of {n} tokens is longer than one memory entry holds ({self.fact_tokens} tokens); "
                "split it into shorter facts",
                param=param,
                code="fact_too_long",
            )

    def check_extraction(self, speaker: str, text: str, param: str) -> None:
        """A message that facts will be extracted from."""
        n = len(self.layout.extraction_prompt_ids(speaker, text, self.max_facts_per_turn))
        if n >= self.context:
            raise RequestRejected(
                f"{param}: extracting facts from this message needs a {n}-token prompt; the context holds {self.context}",
                param=param,
                code="context_length_exceeded",
            )

    def check_add(self, request: AddMemoryRequest) -> None:
        """Every token bound of a memory add, all checked before anything is stored."""
        for i, message in enumerate(request.messages or []):
            param = f"messages.{i}.content"
            if message.role == "user" and request.infer:
                self.check_extraction(message.role, message.content, param)
            if message.role == "user" and not request.infer:  # stored as a fact as it is
                if not message.content.strip():
                    raise RequestRejected(f"{param}: an empty message cannot be stored as a fact", param=param)
                self.check_fact(message.content, param)
        for i, fact in enumerate(request.facts or []):
            self.check_fact(fact, f"facts.{i}")

    def fitting(self, facts: list[NewFact]) -> list[NewFact]:
        """The facts that fit one arena entry (only an extracted one can be too long: given ones were checked)."""
        kept = [f for f in facts if self.fact_fits(f.text)]
        if len(kept) < len(facts):
            logger.warning("dropped %d extracted facts longer than an arena entry", len(facts) - len(kept))
        return kept

    # ---------------------------------------------------------------- chat
    def planned_output(self, asked: int | None, param: str) -> int:
        """The output the prompt must leave room for: the ask (refused above max_output_tokens) or the default."""
        if asked is not None and self.max_output is not None and asked > self.max_output:
            raise RequestRejected(
                f"{param}={asked} exceeds this service's limit of {self.max_output} tokens per answer",
                param=param,
                code="max_tokens_exceeded",
            )
        if asked is not None and asked >= self.context:  # no prompt fits beside it: refused before planning
            raise RequestRejected(
                f"{param}={asked} exceeds the context length of {self.context} tokens (no room is left for a prompt)",
                param=param,
                code="context_length_exceeded",
            )
        return asked if asked is not None else self.default_output

    def output_tokens(self, prompt_tokens: int, asked: int | None, planned: int, param: str, prompt_param: str = "messages") -> int:
        """max_tokens for the engine: the ask if prompt + ask fit the context, else a 400; without an
        ask, the planned default lowered to the room left. The 400's `param` is the field at fault:
        `prompt_param` (messages, prompt, input) when the prompt alone leaves no room for one token,
        else the ask (`param`), which a smaller value would make fit."""
        room = self.context - prompt_tokens
        if room < 1:
            raise RequestRejected(
                f"the prompt of {prompt_tokens} tokens alone leaves no room for an answer in the context length of "
                f"{self.context} tokens; shorten {prompt_param}",
                param=prompt_param,
                code="context_length_exceeded",
            )
        wanted = planned if asked is not None else min(planned, room)
        if prompt_tokens + wanted > self.context:
            raise RequestRejected(
                f"prompt of {prompt_tokens} tokens plus {param}={wanted} exceeds the context length of "
                f"{self.context} tokens; at most {room} tokens fit beside this prompt",
                param=param,
                code="context_length_exceeded",
            )
        return wanted

