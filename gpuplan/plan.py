"""The memory plan: one replica's share of its card, split between the parts that live on it.

Pure arithmetic (no torch, vLLM, NVML or Ray): plan_memory(card, inputs) -> MemoryPlan, or
PlanRefused naming the numbers and the settings to change. The parts of a card, per replica
sharing it (llm_replica_num_gpus + shard_num_gpus below 1 puts several replicas on one card; each
plans for its slice, total / replicas_per_card):

- engine: vLLM's gpu_memory_utilization x the card's TOTAL memory. It must cover the weights,
  the activation peak vLLM profiles (estimated from the step's tokens and the model), and paged
  KV for at least max_num_seqs sequences of sequence_tokens (and one of max_model_len, as vLLM
  requires). vLLM refuses to start when the card's free memory is below this share.
- engine overhead: the engine process's CUDA context and CUDA graphs, allocated beside vLLM's share.
- HBM tier: memory.arena.device_pages pages of fact KV, allocated by the connector in the engine
  process (connector.gpu_injector), also beside vLLM's share; at most the arena's host pages.
- shard: the memory shard's CUDA context, embedder and CAGRA index when it is on the card.
- margin: a share of the card left to no one.

`auto` (engine.gpu_memory_utilization, memory.arena.device_pages): the engine gets its minimum,
the HBM tier what is left up to the whole host tier (fact KV in HBM is what shortens an injecting
request's time to first token), and whatever is still left goes to the engine's KV. An explicit
value wins and is checked: too small an engine share, or parts that add up past the slice, are
refused before anything starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpuplan.model_shape import DTYPE_BYTES, ModelShape
from gpuplan.settings import GpuPlanSettings

GiB = 2**30
DEFAULT_STEP_TOKENS = 8192  # vLLM's max_num_batched_tokens on an H100/H200 serving (its default varies 2048-16384)


class PlanRefused(ValueError):
    """The parts do not fit the card (or the card's free memory): the message names the numbers and
    the settings to change."""


@dataclass(frozen=True)
class Card:
    """A card's memory as the replica found it (NVML) or as settings state it (gpu.card_gib)."""

    total_bytes: int
    free_bytes: int
    name: str = "GPU"
    source: str = "nvml"


@dataclass(frozen=True)
class PlanInputs:
    """Everything of the service's settings the plan reads (serve_app.card_plan fills it)."""

    shape: ModelShape
    dtype: str
    max_num_seqs: int
    max_model_len: int
    sequence_tokens: int
    block_size: int = 16
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int | None = None
    cuda_graphs: bool = True
    gpu_memory_utilization: float | None = None  # None: auto
    device_pages: int | None = None  # None: auto
    page_tokens: int = 16
    host_pages: int = 4096
    replicas_per_card: int = 1
    replicas_per_shard: int = 1  # replicas sharing one shard (each slice carries its part of it)
    shard_on_card: bool = False
    settings: GpuPlanSettings = field(default_factory=GpuPlanSettings)


@dataclass(frozen=True)
class MemoryPlan:
    """What each part of one replica's slice of the card got (bytes; as_dict gives GiB)."""

    card: Card
    replicas_per_card: int
    gpu_memory_utilization: float
    engine_bytes: int
    weights_bytes: int
    activation_bytes: int
    kv_bytes: int
    kv_min_bytes: int
    kv_tokens: int
    sequence_tokens: int
    max_num_seqs: int
    engine_overhead_bytes: int
    device_pages: int
    tier_bytes: int
    shard_bytes: int
    margin_bytes: int
    unused_bytes: int
    explicit: tuple[str, ...] = ()

    @property
    def engine_process_bytes(self) -> int:
        """What the engine process allocates: vLLM's share, its graphs and context, the HBM tier."""
        return self.engine_bytes + self.engine_overhead_bytes + self.tier_bytes

    def as_dict(self) -> dict[str, Any]:
        """The plan in GiB and pages (the replica's `memory_plan` in /v1/shards)."""
        gib = lambda b: round(b / GiB, 2)  # noqa: E731
        return {
            "card": {"name": self.card.name, "total_gib": gib(self.card.total_bytes), "free_gib": gib(self.card.free_bytes),
                     "source": self.card.source},
            "replicas_per_card": self.replicas_per_card,
            "engine": {"gpu_memory_utilization": self.gpu_memory_utilization, "gib": gib(self.engine_bytes),
                       "weights_gib": gib(self.weights_bytes), "activation_gib": gib(self.activation_bytes),
                       "kv_gib": gib(self.kv_bytes), "kv_tokens": self.kv_tokens,
                       "kv_min_gib": gib(self.kv_min_bytes), "sequences": f"{self.max_num_seqs} x {self.sequence_tokens} tokens"},
            "engine_overhead_gib": gib(self.engine_overhead_bytes),
            "hbm_tier": {"pages": self.device_pages, "gib": gib(self.tier_bytes)},
            "shard_gib": gib(self.shard_bytes),
            "margin_gib": gib(self.margin_bytes),
            "unused_gib": gib(self.unused_bytes),
            "explicit": list(self.explicit),
        }

    def summary(self) -> str:
        """The one log line of the plan."""
        g = lambda b: f"{b / GiB:.1f}"  # noqa: E731
        return (
            f"memory plan: {self.card.name} {g(self.card.total_bytes)} GiB ({self.card.source}, {g(self.card.free_bytes)} free), "
            f"{self.replicas_per_card} replica(s) on it; this replica: engine {g(self.engine_bytes)} GiB "
            f"(gpu_memory_utilization {self.gpu_memory_utilization}: weights {g(self.weights_bytes)}, activations "
            f"{g(self.activation_bytes)}, KV {g(self.kv_bytes)} = {self.kv_tokens} tokens >= {self.max_num_seqs} x "
            f"{self.sequence_tokens}), graphs+context {g(self.engine_overhead_bytes)}, HBM tier {g(self.tier_bytes)} GiB "
            f"({self.device_pages} pages), shard {g(self.shard_bytes)}, margin {g(self.margin_bytes)}, unused {g(self.unused_bytes)}"
            + (f"; explicit: {', '.join(self.explicit)}" if self.explicit else "")
        )


SETTINGS_TO_CHANGE = (
    "engine.max_num_seqs, gpu.sequence_tokens (the typical sequence; default engine.max_model_len), "
    "memory.arena.device_pages, engine.gpu_memory_utilization, shard_num_gpus (0 keeps the shard off the card), "
    "llm_replica_num_gpus (replicas per card), engine_kwargs.tensor_parallel_size, or a larger card"
)


def activation_bytes(inputs: PlanInputs) -> int:
    """vLLM's profiled peak, estimated: the MLP and residual activations of one step's tokens, the
    sampler's float32 logits for max_num_seqs sequences (twice: logits and probabilities), and
    GpuPlanSettings.activation_floor_gib at least."""
    s, tp = inputs.shape, inputs.tensor_parallel_size
    tokens = inputs.max_num_batched_tokens or DEFAULT_STEP_TOKENS
    per_token = (3 * s.intermediate * s.experts // tp + 6 * s.hidden) * DTYPE_BYTES[inputs.dtype]
    logits = inputs.max_num_seqs * (s.vocab // tp) * 4 * 2
    return max(int(inputs.settings.activation_floor_gib * GiB), tokens * per_token + logits)


def _blocks(tokens: int, block: int) -> int:
    return -(-tokens // block) * block


def plan_memory(card: Card, inputs: PlanInputs) -> MemoryPlan:
    """The replica's plan (module docstring), or PlanRefused."""
    cfg, tp = inputs.settings, inputs.tensor_parallel_size
    rpc = max(1, inputs.replicas_per_card)
    slice_bytes = card.total_bytes // rpc
    kv_per_token = inputs.shape.kv_bytes_per_token(inputs.dtype, tp)
    page_bytes = inputs.page_tokens * inputs.shape.kv_bytes_per_token(inputs.dtype)  # the arena holds every KV head
    weights = inputs.shape.weight_bytes(inputs.dtype, tp)
    activations = activation_bytes(inputs)
    kv_tokens_min = max(inputs.max_num_seqs * _blocks(inputs.sequence_tokens, inputs.block_size),
                        _blocks(inputs.max_model_len, inputs.block_size))
    kv_min = kv_tokens_min * kv_per_token
    engine_need = weights + activations + kv_min
    overhead = int((cfg.engine_overhead_gib if inputs.cuda_graphs else cfg.eager_overhead_gib) * GiB)
    shard = int(cfg.shard_gib * GiB) // max(1, inputs.replicas_per_shard) if inputs.shard_on_card else 0
    margin = int(max(cfg.margin_floor_gib * GiB, cfg.margin_fraction * card.total_bytes)) // rpc
    explicit = []
    if inputs.gpu_memory_utilization is not None:
        explicit.append(f"engine.gpu_memory_utilization {inputs.gpu_memory_utilization}")
        utilization = inputs.gpu_memory_utilization
    else:  # vLLM's share is a fraction of the total: rounded up to 3 decimals, it still covers the need
        utilization = math.ceil(engine_need / card.total_bytes * 1000) / 1000
    engine = int(utilization * card.total_bytes)
    if inputs.device_pages is not None:
        explicit.append(f"memory.arena.device_pages {inputs.device_pages}")
        pages = min(inputs.device_pages, inputs.host_pages)  # the HBM tier holds at most the host tier's pages
    else:
        pages = 0
    fixed = overhead + shard + margin
    left = slice_bytes - engine - fixed - pages * page_bytes
    if engine < engine_need or left < 0:
        raise PlanRefused(_refusal(card, inputs, rpc, engine, engine_need, weights, activations, kv_min, kv_tokens_min,
                                   overhead, pages, page_bytes, shard, margin, slice_bytes))
    if inputs.device_pages is None:  # auto: the HBM tier takes what is left, up to the whole host tier
        pages = min(inputs.host_pages, left // page_bytes)
        left -= pages * page_bytes
    if inputs.gpu_memory_utilization is None:  # auto: the engine's KV takes what is still left
        utilization = round(utilization + math.floor(left / card.total_bytes * 1000) / 1000, 3)
        engine = int(utilization * card.total_bytes)
        left = slice_bytes - engine - fixed - pages * page_bytes
    kv = engine - weights - activations
    return MemoryPlan(
        card=card, replicas_per_card=rpc, gpu_memory_utilization=utilization, engine_bytes=engine, weights_bytes=weights,
        activation_bytes=activations, kv_bytes=kv, kv_min_bytes=kv_min, kv_tokens=kv // kv_per_token,
        sequence_tokens=inputs.sequence_tokens, max_num_seqs=inputs.max_num_seqs, engine_overhead_bytes=overhead,
        device_pages=pages, tier_bytes=pages * page_bytes, shard_bytes=shard, margin_bytes=margin, unused_bytes=left,
        explicit=tuple(explicit),
    )


def _refusal(card: Card, inputs: PlanInputs, rpc: int, engine: int, engine_need: int, weights: int, activations: int,
             kv_min: int, kv_tokens_min: int, overhead: int, pages: int, page_bytes: int, shard: int, margin: int,
             slice_bytes: int) -> str:
    g = lambda b: f"{b / GiB:.1f}"  # noqa: E731
    who = f"{inputs.shape.name or 'the model'} ({inputs.dtype}, tensor_parallel_size {inputs.tensor_parallel_size})"
    parts = (
        f"the engine needs {g(engine_need)} GiB (weights {g(weights)}, activations {g(activations)}, KV {g(kv_min)} "
        f"for {inputs.max_num_seqs} sequences x {inputs.sequence_tokens} tokens = {kv_tokens_min} tokens), its CUDA "
        f"graphs and context {g(overhead)}, the HBM tier {g(pages * page_bytes)} ({pages} pages), the memory shard "
        f"{g(shard)}, margin {g(margin)}"
    )
    where = f"a {g(card.total_bytes)} GiB {card.name}" + (f" shared by {rpc} replicas ({g(slice_bytes)} GiB each)" if rpc > 1 else "")
    if engine < engine_need:
        short = (f"engine.gpu_memory_utilization {inputs.gpu_memory_utilization} gives the engine {g(engine)} GiB of "
                 f"{g(card.total_bytes)}, {g(engine_need - engine)} GiB short")
    else:
        total = engine + overhead + pages * page_bytes + shard + margin
        short = f"{g(total)} GiB in all, {g(total - slice_bytes)} GiB over"
    return f"memory plan refused: {who} on {where}: {parts}; {short}. Change: {SETTINGS_TO_CHANGE}."


def free_memory_refusal(plan: MemoryPlan, free_bytes: int, waited_s: float) -> str | None:
    """Why the replica must not start its engine on a card with `free_bytes` free, or None: vLLM
    refuses when free memory is below its share, and the HBM tier and graphs come on top."""
    need = plan.engine_process_bytes
    if free_bytes >= need:
        return None
    g = lambda b: f"{b / GiB:.1f}"  # noqa: E731
    return (
        f"memory plan refused at start: the {plan.card.name} has {g(free_bytes)} GiB free of {g(plan.card.total_bytes)} "
        f"(after waiting {waited_s:.0f} s) but this replica's engine process needs {g(need)} GiB now (vLLM's "
        f"gpu_memory_utilization {plan.gpu_memory_utilization} = {g(plan.engine_bytes)}, graphs and context "
        f"{g(plan.engine_overhead_bytes)}, HBM tier {g(plan.tier_bytes)}). Another process holds the rest (nvidia-smi "
        f"--query-compute-apps=pid,used_memory --format=csv names it; JAX and TensorFlow preallocate most of a card unless "
        f"kept off it). Free the card, or change: {SETTINGS_TO_CHANGE}."
    )


def plan_dict(plan: MemoryPlan | None, reason: str) -> dict[str, Any]:
    """/v1/shards' memory_plan: the plan, or why there is none (a CPU engine)."""
    return plan.as_dict() if plan is not None else {"none": reason}


__all__ = ["Card", "GiB", "MemoryPlan", "PlanInputs", "PlanRefused", "activation_bytes", "free_memory_refusal", "plan_dict",
           "plan_memory"]
