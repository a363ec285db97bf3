"""A replica's start: its memory plan, its arena, what its engine gets, and the time of each phase.

ReplicaStart is made first thing in the replica's constructor and filled as the start goes (it
also sets gpuplan.environment's variables the process lacks):

- plan_memory: the card plan (serve_app.card_plan, gpuplan) before anything slow starts. The
  card is read with NVML (no CUDA context in the replica's process), or stated by gpu.card_gib;
  a replica without a GPU (a CPU engine) has no plan. A plan that does not fit raises
  PlanRefused; so does a card whose free memory stays below what the engine process is about to
  allocate for gpu.free_wait_s (a replaced replica's engine core may still be exiting). Serve then
  retries the constructor (3 times for one replica) and marks the deployment DEPLOY_FAILED with
  the message (docs/gpu.md, "Failing fast").
- prepare_arena: the replica creates the shard's arena (the shard opens it), so the shard actor
  and the engine start at once on a first start too (serve_app.replica.lifecycle); with a GPU plan
  it allocates the host tier's pages on a thread (commit_host_tier) while vLLM loads.
- engine_overrides / device_pages: the plan's gpu_memory_utilization for vLLM and its HBM-tier
  pages for the connector; explicit settings pass through unchanged.
- explain_engine_failure: an engine that cannot start (vLLM refusing its memory) is reported with
  the plan it was given and the settings to change.
- phases: seconds per phase (process start to constructor, tokenizer, memory plan, arena, shard
  ready, engine built, total), logged as one line and returned in /v1/shards (`start_phases`,
  beside `memory_plan`); the shard's own phases come from its ready() (memory.shard).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from gpuplan.card import stated_card, visible_card
from gpuplan.environment import gpu_env_vars, shard_env_vars
from gpuplan.plan import MemoryPlan, PlanRefused, free_memory_refusal, plan_dict
from serve_app.card_plan import plan_for

if TYPE_CHECKING:
    from serve_app.settings import ServiceSettings

# A child of Serve's "ray.serve" logger: a replica's log file and the terminal of `serve run` show it (the
# replica's root logger has no handler, so a plain module logger's INFO lines go nowhere)
logger = logging.getLogger(f"ray.serve.{__name__}")


class EngineStartFailed(RuntimeError):
    """The engine did not start with the memory it was planned (the message says with what)."""


def _process_age_s() -> float | None:
    """Seconds since this process started (the Ray worker's start and imports before the constructor)."""
    try:
        import psutil  # Ray's own dependency

        return max(0.0, time.time() - psutil.Process(os.getpid()).create_time())
    except Exception:  # noqa: BLE001 - a missing number, not a failed start
        return None


class ReplicaStart:
    """The start of one replica (module docstring)."""

    def __init__(self) -> None:
        # The deployment's runtime_env sets these (serve_app.card_plan.replica_actor_options); a Serve
        # `deployments:` entry's ray_actor_options replaces the builder's whole, so the replica also
        # sets what is missing before anything imports JAX or starts the engine core (which inherits it).
        for name, value in gpu_env_vars().items():
            os.environ.setdefault(name, value)
        self.started = time.monotonic()
        self._last = self.started
        age = _process_age_s()
        self.phases: dict[str, float] = {"process_to_constructor_s": round(age, 2)} if age is not None else {}
        self.plan: MemoryPlan | None = None
        self.no_plan = "not planned yet"
        self.shard_phases: dict[str, float] = {}

    # ------------------------------------------------------------ timing
    def mark(self, phase: str) -> None:
        """`phase` ended now: the time since the previous mark."""
        now = time.monotonic()
        self.phases[f"{phase}_s"] = round(now - self._last, 2)
        self._last = now

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """A phase that overlaps others (the shard and the engine start at once): its own wall time."""
        begun = time.monotonic()
        try:
            yield
        finally:
            self.phases[f"{phase}_s"] = round(time.monotonic() - begun, 2)

    def timed_call(self, phase: str, build: Callable[[str], Any]) -> Callable[[str], Any]:
        """`build` timed as `phase` (the engine's first build; the keeper's rebuilds call `build` itself)."""

        def timed(path: str) -> Any:
            with self.timed(phase):
                return build(path)

        return timed

    def record_shard(self, actor: Any, timeout_s: float = 10.0) -> None:
        """The shard's own start phases (its ready() report), and the shard-and-engine start's wall time."""
        import ray

        self.mark("shard_and_engine")
        try:
            self.shard_phases = dict(ray.get(actor.ready.remote(), timeout=timeout_s).get("start_phases") or {})
        except Exception as exc:  # noqa: BLE001 - a missing number, not a failed start
            logger.warning("the shard's start phases are unknown: %s", exc)

    def finish(self, shard_id: int) -> None:
        """The constructor is done: total time, and the one log line of the start."""
        self.phases["constructor_total_s"] = round(time.monotonic() - self.started, 2)
        shard = ", ".join(f"{k} {v}" for k, v in self.shard_phases.items())
        logger.info("replica %d started: %s; shard: %s", shard_id, ", ".join(f"{k} {v}" for k, v in self.phases.items()), shard or "-")

    def report(self) -> dict[str, Any]:
        """`memory_plan` and `start_phases` for /v1/shards."""
        return {"memory_plan": plan_dict(self.plan, self.no_plan), "start_phases": {**self.phases, "shard": self.shard_phases}}

    # ------------------------------------------------------------ the memory plan
    def plan_memory(self, settings: "ServiceSettings", model: str, kv_dtype: str) -> MemoryPlan | None:
        """The replica's plan, or None without a card (module docstring); PlanRefused when it does not fit."""
        self.mark("tokenizer")  # the constructor's work before this: the tokenizer, the prompt layout, the token limits
        cfg = settings.gpu
        if cfg.card_gib is not None:
            read = lambda: stated_card(cfg.card_gib, cfg.card_free_gib)  # noqa: E731
        elif settings.llm_replica_num_gpus > 0:
            read = visible_card
        else:
            self.no_plan = "the replica has no GPU (llm_replica_num_gpus 0): a CPU engine, nothing on a card to plan"
            self.mark("memory_plan")
            return None
        card = read()
        if card is None:
            self.no_plan = "no GPU visible to the replica (NVML found none, or CUDA_VISIBLE_DEVICES is empty)"
            self.mark("memory_plan")
            return None
        plan = plan_for(settings, model, kv_dtype, card)  # PlanRefused: the parts do not fit the card
        deadline = time.monotonic() + cfg.free_wait_s
        while (refusal := free_memory_refusal(plan, card.free_bytes, cfg.free_wait_s)) is not None:
            if time.monotonic() >= deadline:
                raise PlanRefused(refusal)
            time.sleep(1.0)  # a replaced replica's engine core may still be exiting
            card = read() or card
        self.plan = plan
        logger.info("%s", plan.summary())
        self.mark("memory_plan")
        return plan

    def engine_overrides(self) -> dict[str, Any]:
        """vLLM arguments the plan decides (gpu_memory_utilization), none without a plan."""
        return {"gpu_memory_utilization": self.plan.gpu_memory_utilization} if self.plan is not None else {}

    def device_pages(self, setting: int | str) -> int:
        """HBM-tier pages for the connector: the plan's, an explicit setting's, else 0 (CPU engines)."""
        if self.plan is not None:
            return self.plan.device_pages
        return 0 if setting == "auto" else int(setting)

    def shard_env(self) -> dict[str, str]:
        """The shard actor's environment (gpuplan.environment), CuPy capped at the shard's share."""
        return shard_env_vars(self.plan.shard_bytes if self.plan is not None else None)

    @contextlib.contextmanager
    def explain_engine_failure(self) -> Iterator[None]:
        """An engine that does not start is reported with its plan and the settings to change."""
        try:
            yield
        except Exception as exc:
            given = self.plan.summary() if self.plan is not None else f"no memory plan ({self.no_plan})"
            raise EngineStartFailed(
                f"the engine did not start: {type(exc).__name__}: {exc}. It was given: {given}. vLLM's own reason is in the "
                "engine core's log lines above (for memory: 'Free memory on device ... is less than desired GPU memory "
                "utilization', or too little KV cache for max_model_len): change engine.gpu_memory_utilization, "
                "memory.arena.device_pages, engine.max_num_seqs or gpu.sequence_tokens (docs/gpu.md)."
            ) from exc

    # ------------------------------------------------------------ the arena
    def prepare_arena(self, path: Path, geometry: Any) -> None:
        """Create the shard's arena here (the shard opens it), so shard and engine start at once. An
        arena of another geometry (other settings) is replaced, as the shard would: its KV is derived."""
        from kvarena.arena import ArenaError, FactArena

        try:
            arena = FactArena.create(path, geometry, exist_ok=True)
        except ArenaError:
            logger.warning("replacing the arena at %s (geometry changed)", path)
            shutil.rmtree(path)
            arena = FactArena.create(path, geometry)
        arena.close()
        if self.plan is not None:  # a GPU engine pins the host tier: commit its pages meanwhile (commit_host_tier)
            threading.Thread(target=commit_host_tier, args=(path / "kv.bin",), name="commit-host-tier", daemon=True).start()
        self.mark("arena")


def commit_host_tier(kv_file: Path) -> float | None:
    """Allocate every page of the host tier's file (posix_fallocate) and return the seconds it took.

    kv.bin is created sparse. On a GPU the engine's worker pins it whole with cudaHostRegister
    (connector.host_pinning), which faults its pages in one by one on the engine's start path (12 GiB
    took about 12 s on the H100 visit, docs/gpu.md). Allocated here, in the replica, while vLLM is being
    imported and its engine core spawned, the pin only maps pages that exist. The memory is the same
    (the pin commits all of it anyway); fallocate releases the GIL. A failure only costs the time back.
    """
    began = time.monotonic()
    try:
        fd = os.open(kv_file, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError as exc:
        logger.warning("the host tier's pages were not allocated ahead of the pin (%s): the pin faults them in", exc)
        return None
    took = time.monotonic() - began
    logger.info("allocated the host tier (%.1f GiB, %s) in %.1f s, ahead of the engine's pin", size / 2**30, kv_file, took)
    return took


__all__ = ["EngineStartFailed", "PlanRefused", "ReplicaStart", "commit_host_tier"]
