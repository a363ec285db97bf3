"""What keeps an LLM replica's engine and memory shard up: start-up, in-place engine restart, health.

Start-up (start_engine_and_shard): the replica starts (or finds) its MemoryShard actor and its
vLLM engine. The engine only needs the shard's arena, which lives in shared memory and outlives
both processes, so when the arena is already there the engine starts while the shard actor
loads; start_backends creates it first (serve_app.replica.startup), so that is every start. The
shard actor is detached (actors.shard_actor): it outlives its replicas, and a replica finds it
by name; one that is dying (killed) is waited out until the name is free, one started with
other settings is replaced.

EngineKeeper: when the engine core process dies (AsyncLLM.errored), the keeper builds a new
engine in a worker thread (the event loop keeps serving health checks, memory reads and 503s
meanwhile) and swaps it in; the new engine's connector clears the pins the dead one held in its
engine slot. Its report says "ok", "restarting: …" or "dead: …"; `failure()` is what the
replica's Serve check_health raises: set when the engine is dead and no restart is under way, or
the restart ran past its timeout, or `max_restarts` restarts in a row failed, or at once when
the shard has other replicas to serve its users. Serve then replaces the whole replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import ray
from ray.exceptions import RayActorError

from connector.engine_config import kv_transfer_config
from kvarena.arena import ArenaError, FactArena, arena_geometry_for
from serve_app.replica.engine import build_async_engine
from serve_app.replica.startup import ReplicaStart

if TYPE_CHECKING:
    from serve_app.settings import ServiceSettings

logger = logging.getLogger(__name__)


def engine_dead(engine: Any) -> bool:
    """An AsyncLLM whose engine core exited (or whose output handler stopped)."""
    return bool(getattr(engine, "errored", False))


class EngineKeeper:
    """Holds the replica's engine and restarts it in place when it dies (module docstring)."""

    def __init__(
        self,
        engine: Any,
        build: Callable[[], Any],
        restart_timeout_s: float,
        max_restarts: int,
        on_swap: Callable[[Any], None] | None = None,
        log_stats_interval_s: float = 0.0,
        restart_in_place: bool = True,
        on_give_up: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_give_up = on_give_up  # called once when the engine died and is not restarted here
        # False when other replicas serve the same shard: a dead engine makes the replica unhealthy
        # at once (Serve replaces it while they answer) and no engine is built here meanwhile
        self.restart_in_place = restart_in_place
        self.build = build  # a fresh engine (blocking: runs in a worker thread)
        self.restart_timeout_s = restart_timeout_s
        self.max_restarts = max_restarts
        self.on_swap = on_swap
        self.log_stats_interval_s = log_stats_interval_s  # vLLM's stats line (AsyncLLM.do_log_stats); 0: never
        self.restarts = 0  # engines built to replace a dead one
        self.last_recovery_s: float | None = None
        self._dead_since: float | None = None
        self._failed_restarts = 0
        self._last_error: str | None = None
        self._restarting: asyncio.Task | None = None
        self._watching: asyncio.Task | None = None
        self.closed = False

    def watch(self, period_s: float = 0.5) -> None:
        """Start (once) the loop that notices a dead engine and restarts it."""
        if not self.closed and (self._watching is None or self._watching.done()):
            self._watching = asyncio.get_running_loop().create_task(self._watch(period_s))

    def close(self) -> None:
        """The replica shuts down: its engine stops on purpose and is not restarted."""
        self.closed = True
        for task in (self._watching, self._restarting):
            if task is not None and not task.done():
                try:
                    task.get_loop().call_soon_threadsafe(task.cancel)
                except RuntimeError:  # its loop is closed already
                    pass

    async def _watch(self, period_s: float) -> None:
        logged_at = time.monotonic()
        while True:
            await asyncio.sleep(period_s)
            if self.closed:
                return
            if self.log_stats_interval_s and time.monotonic() - logged_at >= self.log_stats_interval_s and not engine_dead(self.engine):
                logged_at = time.monotonic()
                try:
                    await self.engine.do_log_stats()
                except Exception as exc:  # noqa: BLE001 - a log line is never worth a restart
                    logger.debug("engine stats: %s", exc)
            if engine_dead(self.engine) and not self.restart_in_place and self.on_give_up is not None:
                give_up, self.on_give_up = self.on_give_up, None
                give_up()
            if engine_dead(self.engine) and self.restart_in_place and (self._restarting is None or self._restarting.done()):
                if self._failed_restarts >= self.max_restarts:
                    continue  # given up: check_health reports it and Serve replaces the replica
                self._dead_since = self._dead_since or time.monotonic()
                self._restarting = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        dead = self.engine
        logger.error("engine core died; starting a new engine in place")
        try:
            await asyncio.wait_for(asyncio.to_thread(dead.shutdown, 5.0), 20.0)
        except Exception as exc:  # noqa: BLE001 - a dead engine's clean-up may fail; the new one does not need it
            logger.warning("shutdown of the dead engine: %s", exc)
        try:
            engine = await asyncio.to_thread(self.build)
        except Exception as exc:  # noqa: BLE001 - reported through status and check_health
            self._failed_restarts += 1
            self._last_error = f"{type(exc).__name__}: {exc}"[:300]
            logger.exception("engine restart %d failed", self._failed_restarts)
            return
        self.engine = engine
        if self.on_swap is not None:
            self.on_swap(engine)
        self.restarts += 1
        self.last_recovery_s = time.monotonic() - (self._dead_since or time.monotonic())
        self._dead_since, self._failed_restarts, self._last_error = None, 0, None
        logger.warning("engine restarted in place %.1f s after it died", self.last_recovery_s)

    def status(self) -> str:
        """"ok", "restarting: …" or "dead: …" (the engine half of the replica's health report)."""
        if not engine_dead(self.engine):
            return "ok"
        failure = self.failure()
        if failure is not None:
            return failure
        since = time.monotonic() - self._dead_since if self._dead_since else 0.0
        return f"restarting: the engine core died {since:.0f} s ago; a new engine is starting"

    def failure(self) -> str | None:
        """Why the replica is unhealthy (what check_health raises), or None. Without restart_in_place
        (other replicas serve the same shard) a dead engine is a failure at once: Serve replaces the
        replica while the others answer, sooner than an in-place restart here would."""
        if not engine_dead(self.engine):
            return None
        if not self.restart_in_place:
            return "dead: the engine core exited; the shard's other replicas serve its users while this one is replaced"
        restarting = self._restarting is not None and not self._restarting.done()
        if self._failed_restarts >= self.max_restarts:
            return f"dead: {self._failed_restarts} engine restarts failed, the last with {self._last_error}"
        if restarting and self._dead_since and time.monotonic() - self._dead_since > self.restart_timeout_s:
            return f"dead: the engine restart has run past {self.restart_timeout_s:.0f} s"
        if not restarting and self._watching is None:
            return "dead: the engine core exited and no restart is under way"
        return None


@contextlib.contextmanager
def one_engine_start_at_a_time(folder: Path, timeout_s: float, poll_s: float = 0.2) -> Iterator[None]:
    """Engines on one card (one host without GPUs) start one after another: vLLM measures the card's
    free memory while it profiles, and another engine allocating at the same moment skews what it
    takes for its KV cache (on 2 CPU cores two starts at once also take twice as long each). A file
    lock in `folder` (the arenas' folder, on this host), per card Ray gave this process; waited for
    at most `timeout_s`, then the start goes ahead anyway."""
    cards = "-".join(str(i) for i in ray.get_gpu_ids()) if ray.is_initialized() else ""
    path = folder / f"kvmem-engine-start{'-gpu' + cards if cards else ''}.lock"
    handle = open(path, "a+")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    logger.warning("another engine's start held %s for %.0f s: starting anyway", path, timeout_s)
                    break
                time.sleep(poll_s)
        yield
    finally:
        handle.close()  # releases the lock


def _arena_ready(path: Path, geometry: Any) -> bool:
    """Whether an arena with this geometry is already at `path` (left by a previous replica)."""
    try:
        arena = FactArena.open(path)
    except (ArenaError, OSError, ValueError):
        return False
    try:
        return arena.geometry == geometry
    finally:
        arena.close()


def _live_shard(start: Callable[[], Any], timeout_s: float, fingerprint: str | None = None) -> Any:
    """The shard actor once it answers; a dying predecessor under the same name is waited out, and
    one started with other settings (`fingerprint`: an earlier deployment's shard, which outlives
    its replicas) is ended and started anew."""
    deadline = time.monotonic() + timeout_s
    while True:
        actor = start()
        try:
            found = ray.get(actor.ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except RayActorError as exc:
            if time.monotonic() > deadline:
                raise
            logger.warning("the shard actor found is gone (%s); starting a new one", type(exc).__name__)
            time.sleep(0.5)
            continue
        if fingerprint is None or found.get("fingerprint") == fingerprint:
            return actor
        logger.warning("the shard actor found was started with other settings; replacing it")
        ray.kill(actor, no_restart=True)
        time.sleep(0.5)


def start_engine_and_shard(
    start_shard: Callable[[], Any],
    build_engine: Callable[[str], Any],
    arena_path: Path,
    geometry: Any,
    timeout_s: float = 600.0,
    fingerprint: str | None = None,
) -> tuple[Any, Any]:
    """(shard actor, engine): the engine starts beside the shard when the arena already exists,
    after it otherwise (the shard creates the arena)."""
    if not _arena_ready(arena_path, geometry):
        actor = _live_shard(start_shard, timeout_s, fingerprint)  # the shard's first start loads its models
        return actor, build_engine(str(arena_path))
    with ThreadPoolExecutor(1, thread_name_prefix="engine-start") as pool:
        engine = pool.submit(build_engine, str(arena_path))
        try:
            actor = _live_shard(start_shard, timeout_s, fingerprint)
        except BaseException:
            engine.result().shutdown()  # no half-started replica keeps an engine core running
            raise
        return actor, engine.result()


def _retry_predecessors_jobs(actor: Any, engine_slot: int) -> None:
    """The encode jobs the engine that held this slot before took (its replica died mid-encode) are
    retried now rather than after memory.encode_timeout_s (MemoryShard.engine_started)."""
    try:
        retried = ray.get(actor.engine_started.remote(engine_slot), timeout=30)
    except Exception as exc:  # noqa: BLE001 - they are retried after their timeout anyway
        logger.warning("could not release the encode jobs of engine slot %d's predecessor: %s", engine_slot, exc)
        return
    if retried:
        logger.warning("retried %d encode jobs left by engine slot %d's predecessor", retried, engine_slot)


class EngineSlot:
    """This replica's engine slot in its shard's arena (kvarena.arena.FactArena.claim_engine_slot),
    claimed when the engine first starts (the arena exists by then), kept across in-place engine
    restarts, given up when the engine died for good here (another replica replaces this one)."""

    def __init__(self, arena_path: Path) -> None:
        self.arena_path = arena_path
        self.slot: int | None = None

    def claim(self) -> int:
        arena = FactArena.open(self.arena_path)
        try:
            self.slot = arena.claim_engine_slot(os.getpid())
        finally:
            arena.close()
        return self.slot

    def release(self) -> None:
        if self.slot is None:
            return
        try:
            arena = FactArena.open(self.arena_path)
        except (ArenaError, OSError):
            return
        try:
            arena.release_engine_slot(self.slot, os.getpid())
        finally:
            arena.close()
        logger.warning("gave engine slot %d of %s up", self.slot, self.arena_path)


def start_backends(
    settings: "ServiceSettings", shard_id: int, model: str, kv_dtype: str, start: "ReplicaStart | None" = None
) -> tuple[Any, EngineKeeper, EngineSlot]:
    """(shard actor, EngineKeeper over the engine, its slot) of a replica of shard `shard_id`: the
    engine pins under its claimed slot in the shard's arena, and the shard encodes into the
    engine's context (encode_context_tokens = max_model_len). The memory plan comes first and
    sizes the engine and its HBM tier (serve_app.replica.startup; PlanRefused stops the start there)."""
    from actors.shard_actor import shard_fingerprint, start_shard_actor  # memory.shard loads torch: not in `serve run`'s driver

    start = start or ReplicaStart()
    start.plan_memory(settings, model, kv_dtype)
    memory = settings.memory.model_copy(update={"encode_context_tokens": settings.engine.max_model_len})
    arena_path = memory.arena_path(settings.namespace, shard_id)
    geometry = arena_geometry_for(model, kv_dtype, **memory.arena.model_dump(exclude={"device_pages"}))
    start.prepare_arena(arena_path, geometry)  # the shard opens it: shard and engine start at once

    slot = EngineSlot(arena_path)

    def build_engine(path: str = str(arena_path)) -> Any:
        connector = kv_transfer_config(path, device_pages=start.device_pages(memory.arena.device_pages), engine_slot=slot.claim())
        with one_engine_start_at_a_time(Path(memory.arena_dir), settings.engine_restart_timeout_s), start.explain_engine_failure():
            # encodes run below chats (priority scheduling)
            return build_async_engine(settings.engine, model, kv_transfer_config=connector, scheduling_policy="priority",
                                      **start.engine_overrides())

    actor, engine = start_engine_and_shard(
        lambda: start_shard_actor(
            shard_id, memory, model, kv_dtype, settings.redis_url, settings.namespace, settings.shard_num_gpus,
            redis_password=settings.redis_password_value(), orphan_timeout_s=settings.shard_orphan_timeout_s,
            env_vars=start.shard_env(),
        ),
        start.timed_call("engine", build_engine),
        arena_path,
        geometry,
        fingerprint=shard_fingerprint(memory, model, kv_dtype, settings.redis_url, settings.namespace),
    )
    start.record_shard(actor)
    _retry_predecessors_jobs(actor, slot.slot)
    keeper = EngineKeeper(engine, build_engine, settings.engine_restart_timeout_s, settings.engine_max_restarts,
                          log_stats_interval_s=settings.engine.log_stats_interval_s,
                          restart_in_place=settings.llm_replicas_per_shard == 1, on_give_up=slot.release)
    start.finish(shard_id)  # one log line: each phase of this start (also in the replica's stats())
    return actor, keeper, slot
