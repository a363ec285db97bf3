"""GpuPlanSettings: how the memory plan (gpuplan.plan) reads and splits a card (the `gpu:` block of
the service's settings). Pydantic only; imports no implementation.

How the card is shared is said by two settings elsewhere, each a number or `auto`:
engine.gpu_memory_utilization (vLLM's fraction of the card's total memory) and
memory.arena.device_pages (the HBM tier of fact KV, in arena pages). This block holds what the
plan needs besides: the typical served sequence, the reserves of the parts vLLM does not count,
and a stated card for dry runs.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GpuPlanSettings(BaseModel):
    """What the memory plan assumes and reserves (docs/gpu.md, "The card's memory plan")."""

    model_config = ConfigDict(extra="forbid")

    sequence_tokens: int | None = Field(
        None,
        gt=0,
        description="Tokens (prompt + output) of a typical served sequence: the engine's paged KV must hold "
        "engine.max_num_seqs sequences of this length (and at least one of engine.max_model_len, as vLLM requires). "
        "None: engine.max_model_len, the worst case. A chat with k = 50 facts is about 1,100-1,300 prompt tokens, so "
        "config.gpu.yaml says 1536; longer sequences still run, vLLM then batches fewer of them at once.",
    )
    card_gib: float | None = Field(
        None,
        gt=0,
        description="Plan for a card of this many GiB instead of reading the replica's card (a dry run, a test, or a "
        "CPU machine checking a GPU configuration): the plan is computed, logged and enforced as if the card were there.",
    )
    card_free_gib: float | None = Field(
        None, gt=0, description="With card_gib: the free memory to assume at start (default: all of it)."
    )
    shard_gib: float = Field(
        3.0,
        ge=0,
        description="What a memory shard on the card (shard_num_gpus > 0) holds: its CUDA context, the query "
        "embedder, the CAGRA index (about 1.8 KiB per fact at 384 dimensions) and torch's cache. Measured 0.6-2.7 GiB "
        "on an H100; 0 when the shard is off the card.",
    )
    engine_overhead_gib: float = Field(
        2.5,
        ge=0,
        description="What the engine process holds beside vLLM's gpu_memory_utilization share with CUDA graphs on: its "
        "CUDA context and the graphs (captured after vLLM sizes its KV cache). The H100 measurement (48-50 GiB for the "
        "engine process = 39.6 vLLM + 8 HBM tier + this) bounds it by 0.4-2.4 GiB.",
    )
    eager_overhead_gib: float = Field(
        0.6, ge=0, description="The same with engine.enforce_eager (no CUDA graphs): the CUDA context alone."
    )
    activation_floor_gib: float = Field(
        1.0,
        ge=0,
        description="Least activation reserve inside vLLM's share (its profiling peak, the sampler's logits, cuBLAS "
        "workspaces); the plan estimates it from the step's tokens and the model and takes the larger.",
    )
    margin_fraction: float = Field(
        0.02, ge=0, lt=0.5, description="Share of the card left to no one (fragmentation, a driver's own use)."
    )
    margin_floor_gib: float = Field(0.5, ge=0, description="Least margin in GiB.")
    free_wait_s: float = Field(
        10.0,
        ge=0,
        description="Most seconds a starting replica waits for the card's free memory to reach what its engine needs "
        "(a replaced replica's engine core may still be exiting) before it refuses to start.",
    )
