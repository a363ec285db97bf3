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
capture: after the prompt is computed, copy the KV of prompt tokens [start, start + entry
         length) into the entry (allocated beforehand by the arena's owner).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PARAMS_KEY = "kvmem"


class EntryPlacement(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    entry: int = Field(..., ge=0, description="Arena entry id.")
    generation: int = Field(..., ge=1, description="Generation the entry was allocated with.")
    start: int = Field(..., ge=0, description="Prompt position of the entry's first token.")


class KVMemoryParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inject: list[EntryPlacement] = Field(default_factory=list, description="Entries to inject.")
    capture: EntryPlacement | None = Field(None, description="Entry to fill from this prompt's KV.")

    @classmethod
    def from_kv_transfer_params(cls, kv_transfer_params: dict[str, Any] | None) -> "KVMemoryParams | None":
        """None when the request names no memory operation; raises ValidationError when malformed."""
        if not kv_transfer_params or PARAMS_KEY not in kv_transfer_params:
            return None
        return cls.model_validate(kv_transfer_params[PARAMS_KEY])

    def to_kv_transfer_params(self) -> dict[str, Any]:
        return {PARAMS_KEY: self.model_dump(exclude_none=True)}
