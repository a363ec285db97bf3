"""Token layout of memory-conditioned prompts, encode prompts and extraction prompts.

Served prompt (token ids, concatenated):

    [prefix][fact_1][fact_2]...[fact_k][suffix]

where prefix + suffix is the model's own chat template around the conversation, with the
memory inside the system message: the template is rendered once with a marker where the
memory goes and split there. The prefix is the same for every request, so it is captured
once into the arena and injected too; the facts are injected; only the suffix (the user's
messages and the generation prompt) is prefilled.

Encode prompt of a fact: [prefix][window][bridge][neighbours][fact], the window being the w
conversation turns before the fact's source turn, the bridge (memory.window_bridge, after a
non-empty window only) the text that hands back from the conversation to the fact list, and the
neighbours (memory.encode_neighbours) the user's facts closest to this one, as fact segments, least
similar first: at serving time a fact sits behind other facts of the list, and encoded behind its
neighbours it is a later item of a list at encode time too, and has attended to the facts most
likely retrieved with it (the offline half of FusionRAG). When the prompt does not fit the engine's
context, the window is trimmed first (oldest turns first), then the neighbours (least similar first).
The fact's KV is captured from this prompt (DESIGN §4: the kept slice is exactly what a prefill of
[prefix; window; neighbours; fact] produces for it).

The suffix starts with the memory closing (memory.memory_closing, e.g. a line that ends the
fact list), prefilled in every mode right after the facts.

Fact segments are tokenized on their own ("- text\\n"); both prompt and KV injection use the
same token ids, so the two paths see identical inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from memory.records import Turn
from memory.settings import DEFAULT_INSTRUCTION

MEMORY_MARKER = "\u2063KVMEM_MEMORY\u2063"

EXTRACTION_INSTRUCTION = (
    "Extract at most {n} short, standalone facts about the speaker from the message below. "
    "Each fact is one sentence that names the speaker. Answer in JSON: {{\"facts\": [...]}}. "
    "Return an empty list when the message holds no lasting fact."
)


def extraction_schema(max_facts: int) -> dict[str, Any]:
    """JSON schema the extraction output is constrained to (vLLM structured outputs)."""
    return {
        "type": "object",
        "properties": {
            "facts": {"type": "array", "items": {"type": "string", "maxLength": 300}, "maxItems": max_facts}
        },
        "required": ["facts"],
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class EncodePrompt:
    token_ids: list[int]
    start: int  # first token of the fact segment
    length: int  # fact segment tokens


class PromptLayout:
    """Builds token ids for served, encode and extraction prompts with one tokenizer."""

    def __init__(
        self, tokenizer: Any, instruction: str = DEFAULT_INSTRUCTION, window_bridge: str = "", memory_closing: str = ""
    ) -> None:
        self.tokenizer = tokenizer
        # A fast tokenizer's Rust backend, called directly: the same ids as tokenizer(text) (tested)
        # at a tenth of its per-call overhead, which every chat request pays on its planning path.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.instruction = instruction
        self.memory_closing = memory_closing  # prefilled right after the facts, in every mode
        self.bridge_ids: list[int] = self._encode(window_bridge) if window_bridge else []  # between window and fact
        rendered = self._render([{"role": "system", "content": instruction + MEMORY_MARKER}], generation=False)
        if rendered.count(MEMORY_MARKER) != 1:
            raise ValueError("the chat template does not place the system message verbatim")
        prefix_text, _ = rendered.split(MEMORY_MARKER)
        self._prefix_text = prefix_text
        self.prefix_ids: list[int] = self._encode(prefix_text)

    def _render(self, messages: list[dict[str, str]], generation: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ---------------------------------------------------------------- served prompts
    def fact_ids(self, text: str) -> list[int]:
        return self._encode(f"- {text.strip()}\n")

    def suffix_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Everything after the memory: the end of the system message, the conversation and the
        generation prompt. A caller's own system messages go after the memory, inside ours."""
        system = "\n".join(m["content"] for m in messages if m["role"] == "system")
        rest = [dict(m) for m in messages if m["role"] != "system"]
        content = self.instruction + MEMORY_MARKER + self.memory_closing + (("\n" + system) if system else "")
        rendered = self._render([{"role": "system", "content": content}, *rest], generation=True)
        head, tail = rendered.split(MEMORY_MARKER)
        if head != self._prefix_text and self._encode(head) != self.prefix_ids:  # the same text: the same ids
            raise ValueError("the chat template renders the memory prefix differently per conversation")
        return self._encode(tail)

    def plain_prompt_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The conversation without memory (the model's own chat template, untouched)."""
        return self._encode(self._render([dict(m) for m in messages], generation=True))

    # ---------------------------------------------------------------- encode prompts
    def window_ids(self, turns: Sequence[Turn]) -> list[int]:
        if not turns:
            return []
        lines = "".join(f"{t.speaker}: {t.text.strip()}\n" for t in turns)
        return self._encode(f"(conversation) {lines}")

    def encode_prompt(
        self, fact_text: str, window: Sequence[Turn], max_tokens: int | None = None, neighbours: Sequence[str] = ()
    ) -> EncodePrompt:
        """[prefix][window][bridge][neighbours][fact]; with max_tokens, the neighbours are dropped
        (least similar first) until [prefix][neighbours][fact] fits, then the window is trimmed into
        the room left (_fitted_window). Raises ValueError when [prefix][fact] alone does not fit."""
        fact = self.fact_ids(fact_text)
        room = None if max_tokens is None else max_tokens - len(self.prefix_ids) - len(fact)
        if room is not None and room < 0:
            raise ValueError(
                f"the encode prompt of a {len(fact)}-token fact behind the {len(self.prefix_ids)}-token prefix "
                f"exceeds {max_tokens} tokens"
            )
        segments = [self.fact_ids(text) for text in neighbours]
        while room is not None and segments and sum(map(len, segments)) > room:
            segments.pop(0)
        neighbour_ids = [token for segment in segments for token in segment]
        if room is not None:
            room -= len(neighbour_ids)
        bridge = self.bridge_ids if window else []
        if room is not None and room < len(bridge):
            bridge = []
        window_ids = self._fitted_window(window, None if room is None else room - len(bridge))
        head = self.prefix_ids + window_ids + (bridge if window_ids else []) + neighbour_ids
        return EncodePrompt(token_ids=head + fact, start=len(head), length=len(fact))

    def _fitted_window(self, window: Sequence[Turn], room: int | None) -> list[int]:
        """The window's tokens within `room` tokens (None: all): the oldest turns are dropped first;
        when the newest turn alone is too long, only its last tokens (right before the fact) stay."""
        turns = list(window)
        ids = self.window_ids(turns)
        while room is not None and len(ids) > room and len(turns) > 1:
            turns.pop(0)
            ids = self.window_ids(turns)
        if room is None or len(ids) <= room:
            return ids
        header = self._encode("(conversation) ")
        if room <= len(header):
            return []
        return header + ids[len(ids) - (room - len(header)) :]  # the newest text of the one turn left

    # ---------------------------------------------------------------- extraction
    def extraction_prompt_ids(self, speaker: str, text: str, max_facts: int) -> list[int]:
        messages = [
            {"role": "system", "content": EXTRACTION_INSTRUCTION.format(n=max_facts)},
            {"role": "user", "content": f"{speaker}: {text}"},
        ]
        return self._encode(self._render(messages, generation=True))
