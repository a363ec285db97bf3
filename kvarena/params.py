"""Per-request memory parameters: the `kvmem` key of kv_transfer_params (no vLLM, no torch).

The contract between whoever plans a request (the memory shard) and the connector that runs it.

A request names its memory operations in SamplingParams(extra_args={"kv_transfer_params":
{"kvmem": {...}}}) (or the `kv_transfer_params` field of an OpenAI request body):

    {"kvmem": {
        "inject":  [{"entry": 12, "generation": 3, "start": 40}, ...],
        "capture": {"entry": 7, "generation": 1, "start": 100}
    }}

inject:  arena entries whose KV stands for prompt tokens [start, start + entry length); the
         prompt must hold exactly the entry's tokens there (checked), and the request must carry
         a cache_salt (injected blocks enter the prefix cache under it).
inject_columns: the same list column-wise, {"entry": [...], "generation": [...], "start": [...]},
         which is what to_kv_transfer_params emits: a request may inject 50+ entries, and an object
         each is work for the front end (copies, msgpack) and the connector's validation on the
         engine's critical path (scheduler side at k = 50: 380 -> 326 us, docs/gpu.md). A request
         names one form or the other.
capture: after the prompt is computed, copy the KV of prompt tokens [start, start + entry
         length) into the entry (allocated beforehand by the arena's owner).
"""

from __future__ import annotations

from typing import Any

from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

PARAMS_KEY = "kvmem"

# Bounded so that every value fits the connector's int64 arithmetic (entry ids are int32 in the
# arena's tables, positions are far below any context length): a value beyond them is a
# validation error, which the connector answers with a plain prefill, not a crashed engine step.
EntryId = Annotated[int, Field(ge=0, lt=2**31)]
Generation = Annotated[int, Field(ge=1, lt=2**62)]
Position = Annotated[int, Field(ge=0, lt=2**31)]


class EntryPlacement(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    entry: EntryId = Field(..., description="Arena entry id.")
    generation: Generation = Field(..., description="Generation the entry was allocated with.")
    start: Position = Field(..., description="Prompt position of the entry's first token.")


class InjectColumns(BaseModel):
    """Entries to inject, one list per field (index i of each list is one placement)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    entry: list[EntryId] = Field(..., description="Arena entry ids.")
    generation: list[Generation] = Field(..., description="Generations the entries were allocated with.")
    start: list[Position] = Field(..., description="Prompt positions of the entries' first tokens.")

    @model_validator(mode="after")
    def _same_lengths(self) -> "InjectColumns":
        if not len(self.entry) == len(self.generation) == len(self.start):
            raise ValueError("inject_columns: entry, generation and start must have the same length")
        return self


class KVMemoryParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inject: list[EntryPlacement] = Field(default_factory=list, description="Entries to inject.")
    inject_columns: InjectColumns | None = Field(None, description="Entries to inject, column-wise (instead of `inject`).")
    capture: EntryPlacement | None = Field(None, description="Entry to fill from this prompt's KV.")

    @model_validator(mode="after")
    def _one_inject_form(self) -> "KVMemoryParams":
        if self.inject and self.inject_columns is not None:
            raise ValueError("name the injected entries either as `inject` or as `inject_columns`, not both")
        return self

    def inject_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(entry ids, generations, starts) of the injected entries as int64 arrays, either form."""
        if self.inject_columns is not None:
            c = self.inject_columns
            return (np.asarray(c.entry, dtype=np.int64), np.asarray(c.generation, dtype=np.int64), np.asarray(c.start, dtype=np.int64))
        count = len(self.inject)
        return (
            np.fromiter((p.entry for p in self.inject), dtype=np.int64, count=count),
            np.fromiter((p.generation for p in self.inject), dtype=np.int64, count=count),
            np.fromiter((p.start for p in self.inject), dtype=np.int64, count=count),
        )

    @property
    def injects_anything(self) -> bool:
        return bool(self.inject) or (self.inject_columns is not None and len(self.inject_columns.entry) > 0)

    @classmethod
    def from_kv_transfer_params(cls, kv_transfer_params: dict[str, Any] | None) -> "KVMemoryParams | None":
        """None when the request names no memory operation; raises ValidationError when malformed."""
        if not kv_transfer_params or PARAMS_KEY not in kv_transfer_params:
            return None
        return cls.model_validate(kv_transfer_params[PARAMS_KEY])

    def to_kv_transfer_params(self) -> dict[str, Any]:
        """The wire form: injected entries column-wise (see the module docstring)."""
        body = self.model_dump(exclude_none=True, exclude={"inject"})
        if self.inject:
            body["inject_columns"] = {
                "entry": [p.entry for p in self.inject],
                "generation": [p.generation for p in self.inject],
                "start": [p.start for p in self.inject],
            }
        return {PARAMS_KEY: body}
