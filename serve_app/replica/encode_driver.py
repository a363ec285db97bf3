"""EncodeDriver: runs a shard's encode jobs through the engine as capture requests.

The engine lives in the LLM replica; the shard only knows which entries to fill. The driver
takes jobs from the shard, sends each as a one-token request whose kv_transfer_params name the
capture (kvarena.params), and reports back how each ended (memory.kv_lifecycle.EncodeOutcome:
captured, not captured and why, or not run because the engine was down). Facts of the same
turn share their [prefix][window] tokens, so one batch lets vLLM's prefix cache compute that
window once.

Nothing here waits without a bound: a batch that runs past `request_timeout_s` is aborted in
the engine and reported as failed; `drain(deadline_s=...)` and `settle` return at their
deadline; while the engine is dead no job is taken (an engine death costs no fact an attempt).
Encodes run at a lower priority than chats and than extraction (serve_app.replica.scheduling),
and while chats are served (`chats_running`, serve_app.replica.scheduling.ChatsRunning) a batch
holds at most `batch_while_chatting` requests, starts in a gap between chats (waiting at most
`gap_wait_s`) and is followed by a pause, so encodes take at most `share_while_chatting` of the
time: a backlog barely slows the chats served meanwhile, and chats never starve the encodes. The
shard hands out jobs users round robin (memory.fairness.FairQueue).

Works with anything that hands out and takes back jobs (EncodeQueue: an
actors.shard_client.ShardClient over the shard's Ray actor, or over an in-process MemoryShard
in tests and scripts), and with an AsyncLLM (serving) or a synchronous vllm.LLM (scripts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, Callable, Protocol, Sequence

from kvarena.params import PARAMS_KEY
from memory.kv_lifecycle import EncodeJob, EncodeOutcome
from memory.settings import MemorySettings
from serve_app.replica.scheduling import ENCODE_PRIORITY

logger = logging.getLogger(__name__)

MAX_PAUSE_S = 5.0  # the longest pause after a batch while chats run (a batch that ran long)


class ChatActivity(Protocol):
    """Whether chats are being served (serve_app.replica.scheduling.ChatsRunning)."""

    def __call__(self) -> bool: ...  # running, or one ended within the grace

    def running_now(self) -> bool: ...  # running at this moment


class EncodeQueue(Protocol):
    """Where encode jobs come from and go back to (a shard, local or behind Ray)."""

    async def take_encode_jobs(self, max_jobs: int | None = None) -> list[EncodeJob]: ...

    async def complete_encode_jobs(self, outcomes: dict[str, EncodeOutcome]) -> int: ...

    async def encode_pending(self, fact_ids: Sequence[str]) -> list[str]: ...


def _prompt(job: EncodeJob):
    """The capture request's prompt, salted with the fact owner's prefix-cache scope."""
    from vllm.inputs import TokensPrompt  # vLLM: not in `serve run`'s driver

    prompt = TokensPrompt(prompt_token_ids=list(job.token_ids))
    if job.cache_salt:
        prompt["cache_salt"] = job.cache_salt
    return prompt


def _capture_params(job: EncodeJob):
    from vllm import SamplingParams  # vLLM: not in `serve run`'s driver

    # made fresh per job: skip_clone spares vLLM's deep copy of it (as its OpenAI protocol does)
    return SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": job.kv_transfer_params()}, skip_clone=True)


def _captured(output: Any) -> bool:
    report = (getattr(output, "kv_transfer_params", None) or {}).get(PARAMS_KEY) or {}
    return bool(report.get("captured"))


NOT_CAPTURED = "the engine ran the encode prompt but its connector did not capture the fact's range"


def encode_jobs_sync(llm: Any, jobs: Sequence[EncodeJob]) -> dict[str, EncodeOutcome]:
    """Run capture jobs on a synchronous vllm.LLM in one batch; job id -> outcome."""
    if not jobs:
        return {}
    prompts = [_prompt(job) for job in jobs]
    try:
        outputs = llm.generate(prompts, [_capture_params(job) for job in jobs], use_tqdm=False)
    except Exception as exc:  # noqa: BLE001 - one refused prompt fails the batch: tell which
        if len(jobs) == 1:
            return {jobs[0].job_id: f"{type(exc).__name__}: {exc}"[:500]}
        return {job_id: outcome for job in jobs for job_id, outcome in encode_jobs_sync(llm, [job]).items()}
    return {job.job_id: (True if _captured(out) else NOT_CAPTURED) for job, out in zip(jobs, outputs)}


def _engine_down(engine: Any) -> bool:
    """An AsyncLLM whose engine core died (a synchronous LLM raises instead)."""
    return bool(getattr(engine, "errored", False))


async def encode_jobs_async(
    engine: Any, jobs: Sequence[EncodeJob], timeout_s: float | None = None, priority: int = ENCODE_PRIORITY
) -> dict[str, EncodeOutcome]:
    """Run capture jobs concurrently on an AsyncLLM; job id -> outcome. Jobs still running after
    `timeout_s` are aborted (cancelling a generate aborts its request) and reported as failed;
    jobs the engine could not run because it died are reported as not run (None)."""

    async def one(job: EncodeJob) -> Any:
        final = None
        prompt = _prompt(job)
        request_id = f"encode-{uuid.uuid4().hex}"
        async for output in engine.generate(prompt, _capture_params(job), request_id=request_id, priority=priority):
            final = output
        return final

    tasks = [asyncio.ensure_future(one(job)) for job in jobs]
    try:
        _, late = await asyncio.wait(tasks, timeout=timeout_s) if tasks else (set(), set())
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()  # aborts the engine requests
        raise
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    outcomes: dict[str, EncodeOutcome] = {}
    for job, task in zip(jobs, tasks):
        if task in late:
            outcomes[job.job_id] = f"the encode did not finish within {timeout_s:.0f} s and was aborted"
        elif task.exception() is not None:
            exc = task.exception()
            dead = _engine_down(engine) or type(exc).__name__ == "EngineDeadError"
            logger.warning("encode job %s %s: %s", job.job_id, "not run (engine down)" if dead else "failed", exc)
            outcomes[job.job_id] = None if dead else f"{type(exc).__name__}: {exc}"[:500]
        else:
            outcomes[job.job_id] = True if _captured(task.result()) else NOT_CAPTURED
    return outcomes


def _log_failure(task: "asyncio.Future[Any]") -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("facts stored; their KV follows in the background (%s)", task.exception())


def _is_sync_llm(engine: Any) -> bool:
    from vllm import LLM  # vLLM: not in `serve run`'s driver

    return isinstance(engine, LLM)


class EncodeDriver:
    """Drains a shard's encode queue through an engine (see the module docstring). `engine` may
    be replaced (the replica restarts a dead engine in place); batches never overlap."""

    def __init__(
        self,
        queue: EncodeQueue,
        engine: Any,
        batch: int = 32,
        on_batch: Callable[[int, float], None] | None = None,
        request_timeout_s: float | None = None,
        priority: int = ENCODE_PRIORITY,
        chats_running: ChatActivity | None = None,
        batch_while_chatting: int = 1,
        share_while_chatting: float = 1.0,
        gap_wait_s: float = 0.0,
    ):
        self.gap_wait_s = gap_wait_s  # the longest wait for a moment without a running chat before a batch
        self.chats_running = chats_running  # whether the replica is serving chats now (None: never yield)
        self.batch_while_chatting = batch_while_chatting
        self.share_while_chatting = share_while_chatting
        self.queue = queue
        self.engine = engine
        self.batch = batch
        self.on_batch = on_batch  # (facts committed, seconds) after each batch: metrics, progress bars
        self.request_timeout_s = request_timeout_s
        self.priority = priority
        self._lock = asyncio.Lock()  # one batch at a time; held per batch, so drains interleave
        self._work = asyncio.Event()  # set by wake(): facts were queued, do not wait out the idle poll
        self.last_batch_s = 0.0  # how long the last batch ran

    def _chatting(self) -> bool:
        return self.chats_running is not None and self.chats_running()

    async def _wait_for_gap(self) -> None:
        """While chats are served, start a batch when none is running at this moment (a chat's
        client usually leaves a gap before its next), waiting at most `gap_wait_s`: an encode
        started beside a chat shares every step with it; one started in a gap mostly ends in it."""
        if self.chats_running is None or self.gap_wait_s <= 0:
            return
        give_up = time.perf_counter() + self.gap_wait_s
        while self.chats_running.running_now() and time.perf_counter() < give_up:
            await asyncio.sleep(0.01)

    async def _yield_to_chats(self, batch_s: float) -> None:
        """After a batch that ran `batch_s`: while chats run, pause so that encodes take at most
        share_while_chatting of the time (the pause ends early once no chat is served)."""
        share = self.share_while_chatting
        pause_until = time.perf_counter() + min(MAX_PAUSE_S, batch_s * (1.0 - share) / share)
        while self._chatting() and time.perf_counter() < pause_until:
            await asyncio.sleep(min(0.05, pause_until - time.perf_counter()))

    @classmethod
    def for_memory(
        cls, queue: EncodeQueue, engine: Any, memory: MemorySettings, on_batch: Callable[[int, float], None] | None,
        chats_running: ChatActivity | None,
    ) -> "EncodeDriver":
        """The replica's driver: batches, timeout and share while chatting from the memory settings."""
        return cls(queue, engine, memory.encode_batch, on_batch, memory.encode_request_timeout_s, chats_running=chats_running,
                   batch_while_chatting=memory.encode_batch_while_chatting, share_while_chatting=memory.encode_share_while_chatting,
                   gap_wait_s=memory.encode_gap_wait_s)

    async def _one_batch(self) -> int | None:
        """Take, run and report one batch; None when the shard had nothing queued."""
        chatting = self._chatting()
        if chatting:
            await self._wait_for_gap()
        jobs = await self.queue.take_encode_jobs(self.batch_while_chatting if chatting else self.batch)
        if not jobs:
            return None
        started = time.perf_counter()
        try:
            if _is_sync_llm(self.engine):
                outcomes = encode_jobs_sync(self.engine, jobs)
            else:
                outcomes = await encode_jobs_async(self.engine, jobs, self.request_timeout_s, self.priority)
        except asyncio.CancelledError:  # the caller went away: give the jobs back now, not at their expiry
            asyncio.ensure_future(self.queue.complete_encode_jobs({job.job_id: None for job in jobs}))
            raise
        live = await self.queue.complete_encode_jobs(outcomes)
        self.last_batch_s = time.perf_counter() - started
        if self.on_batch is not None:
            self.on_batch(live, self.last_batch_s)
        return live

    async def drain(self, deadline_s: float | None = None, wait_for: Sequence[str] | None = None) -> int:
        """Encode until the shard has nothing queued, or (wait_for) until those facts are no longer
        pending, or until `deadline_s` passes; returns how many entries went live. Returns at once
        while the engine is dead, unless a deadline says how long to wait for it."""
        loop = asyncio.get_running_loop()
        deadline = None if deadline_s is None else loop.time() + deadline_s
        total = 0
        while True:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return total
            if _engine_down(self.engine):
                if left is None:
                    return total
                await asyncio.sleep(min(0.5, left))  # the replica is restarting it
                continue
            try:
                await asyncio.wait_for(self._lock.acquire(), left)
            except asyncio.TimeoutError:
                return total
            try:
                if wait_for is not None and not await self.queue.encode_pending(list(wait_for)):
                    return total
                live = await self._one_batch()
            finally:
                self._lock.release()
            if live is not None and self.share_while_chatting < 1.0:
                await self._yield_to_chats(self.last_batch_s)
            if live is None:
                if wait_for is None:
                    return total
                await asyncio.sleep(0.2 if left is None else min(0.2, left))  # being encoded by another drain
                continue
            total += live

    async def settle(self, fact_ids: Sequence[str], deadline_s: float) -> bool:
        """Wait (encoding) up to `deadline_s` for the facts' KV, then return; a batch still running
        then finishes in the background (its work is not thrown away). Never raises: the facts are
        already stored, and their KV follows. Returns whether the facts' KV is in place."""
        drained = asyncio.ensure_future(self.drain(deadline_s=deadline_s, wait_for=fact_ids))
        drained.add_done_callback(_log_failure)
        done, _ = await asyncio.wait({drained}, timeout=deadline_s)
        if drained not in done or drained.exception() is not None:
            return False
        try:
            return not await asyncio.wait_for(self.queue.encode_pending(list(fact_ids)), 5.0)
        except Exception as exc:  # noqa: BLE001 - a restarting shard: the KV comes later
            logger.warning("facts stored; their KV follows in the background (%s)", exc)
            return False

    def wake(self) -> None:
        """Facts were just queued (an add that does not wait for its KV): run_forever drains now."""
        self._work.set()

    async def run_forever(self, idle_s: float = 0.5) -> None:
        """Background loop: encodes what adds queued (woken by wake()), what a restart rebuild
        queued and evicted facts in use (polled every `idle_s`)."""
        while True:
            try:
                self._work.clear()
                if await self.drain() == 0 and not self._work.is_set():
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._work.wait(), idle_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a shard restarting: its calls fail until it is back
                logger.warning("encode loop: %s; retrying", exc)
                await asyncio.sleep(idle_s)
