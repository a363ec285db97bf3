"""The service's settings as a card plan (gpuplan), and the options that keep each GPU process in it.

Shared by the application builder (its check before anything deploys: `preflight`) and the LLM
replica (its plan at start: serve_app.replica.startup). No torch, no vLLM: the builder imports it.

- replica_actor_options: the Ray options of an LLM replica deployment (both topologies): its CPUs,
  its GPUs and the environment that keeps JAX, TensorFlow and CuPy from pooling the card
  (gpuplan.environment), which vLLM's engine-core subprocess inherits.
- replicas_per_card: how many replicas Ray may pack onto one card (a shard's llm_replicas_per_shard
  replicas of llm_replica_num_gpus each, plus the shard's shard_num_gpus, below 1): they split the
  card, each planning for its slice (and its part of the shard it shares with its siblings).
- plan_for: the plan of one replica on a card (gpuplan.plan.plan_memory) from the settings.
- preflight: where the builder's machine has GPUs (NVML sees them), or gpu.card_gib states one,
  the plan is checked before anything deploys, so `serve run` stops at once with the refusal.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from gpuplan.card import smallest_card, stated_card
from gpuplan.environment import gpu_env_vars
from gpuplan.model_shape import ModelShape, read_model_config
from gpuplan.plan import Card, MemoryPlan, PlanInputs, plan_memory

if TYPE_CHECKING:
    from serve_app.settings import ServiceSettings

logger = logging.getLogger(__name__)

GPU_BLOCK_SIZE = 16  # vLLM's KV block size on GPUs when engine.block_size is not set


def replica_actor_options(settings: "ServiceSettings") -> dict[str, Any]:
    """ray_actor_options of an LLM replica: resources, and the environment of gpuplan.environment."""
    return {
        "num_cpus": settings.llm_replica_num_cpus,
        "num_gpus": settings.llm_replica_num_gpus,
        "runtime_env": {"env_vars": gpu_env_vars()},
    }


def replicas_per_card(settings: "ServiceSettings") -> int:
    """Replicas that may share one card: a shard's replicas and its shard take
    llm_replicas_per_shard x llm_replica_num_gpus + shard_num_gpus; as many such shards as fit in
    one card (Ray packs fractional GPUs onto a card), at most llm_replicas, each with its replicas."""
    per_shard = settings.llm_replicas_per_shard
    share = per_shard * settings.llm_replica_num_gpus + settings.shard_num_gpus
    if share <= 0 or settings.llm_replica_num_gpus >= 1:
        return 1
    return per_shard * max(1, min(settings.llm_replicas, math.floor(1 / share + 1e-9)))


def tensor_parallel_size(settings: "ServiceSettings") -> int:
    return int(settings.engine.engine_kwargs.get("tensor_parallel_size", 1))


def plan_inputs(settings: "ServiceSettings", shape: ModelShape, dtype: str) -> PlanInputs:
    engine, arena = settings.engine, settings.memory.arena
    return PlanInputs(
        shape=shape,
        dtype=dtype,
        max_num_seqs=engine.max_num_seqs,
        max_model_len=engine.max_model_len,
        sequence_tokens=min(settings.gpu.sequence_tokens or engine.max_model_len, engine.max_model_len),
        block_size=engine.block_size or GPU_BLOCK_SIZE,
        tensor_parallel_size=tensor_parallel_size(settings),
        max_num_batched_tokens=engine.max_num_batched_tokens,
        cuda_graphs=not engine.enforce_eager,
        gpu_memory_utilization=None if engine.gpu_memory_utilization == "auto" else float(engine.gpu_memory_utilization),
        device_pages=None if arena.device_pages == "auto" else int(arena.device_pages),
        page_tokens=arena.page_tokens,
        host_pages=arena.num_pages,
        replicas_per_card=replicas_per_card(settings),
        replicas_per_shard=settings.llm_replicas_per_shard,
        shard_on_card=settings.shard_num_gpus > 0,
        settings=settings.gpu,
    )


def gpu_dtype(settings: "ServiceSettings") -> str:
    """The engine's dtype on a GPU (auto is bfloat16 there: serve_app.replica.engine.resolve_dtype)."""
    return "bfloat16" if settings.engine.dtype == "auto" else settings.engine.dtype


def plan_for(settings: "ServiceSettings", model: str, dtype: str, card: Card) -> MemoryPlan:
    """The plan of one replica of `model` on `card`, or gpuplan.plan.PlanRefused."""
    shape = ModelShape.from_config(read_model_config(model), name=model.rstrip("/").rsplit("/", 1)[-1])
    return plan_memory(card, plan_inputs(settings, shape, dtype))


def preflight(settings: "ServiceSettings") -> MemoryPlan | None:
    """The builder's check (module docstring): the plan on the stated card, or on the smallest card
    NVML sees when the replicas get GPUs; None where there is no card to plan for (a CPU service,
    or a machine whose model config cannot be read here: the replica checks at its start).
    Raises PlanRefused when the plan does not fit."""
    if settings.gpu.card_gib is not None:
        card = stated_card(settings.gpu.card_gib, settings.gpu.card_free_gib)
    elif settings.llm_replica_num_gpus > 0:
        card = smallest_card()
    else:
        return None
    if card is None:
        return None
    try:
        config_model = settings.resolved_model()
        plan = plan_for(settings, config_model, gpu_dtype(settings), card)
    except OSError as exc:  # a hub id not in the cache of an offline builder: the replica plans at start
        logger.warning("memory plan not checked before deploying (%s); each replica checks its own card", exc)
        return None
    logger.info("%s", plan.summary())
    return plan
