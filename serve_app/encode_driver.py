"""EncodeDriver: runs a shard's encode jobs through the engine as capture requests.

The engine lives in the LLM replica; the shard only knows which entries to fill. The driver
takes jobs from the shard, sends each as a one-token request whose kv_transfer_params name the
capture (kvarena.params), and reports back which captures the connector scheduled. Facts of
the same turn share their [prefix][window] tokens, so one batch lets vLLM's prefix cache
compute that window once.

Works with anything that hands out and takes back jobs (EncodeQueue: an
actors.shard_client.ShardClient over the shard's Ray actor, or over an in-process MemoryShard
in tests and scripts), and with an AsyncLLM (serving) or a synchronous vllm.LLM (scripts).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Callable, Protocol, Sequence

from memory.kv_lifecycle import EncodeJob
from kvarena.params import PARAMS_KEY

logger = logging.getLogger(__name__)


class EncodeQueue(Protocol):
    """Where encode jobs come from and go back to (a shard, local or behind Ray)."""

    async def take_encode_jobs(self, max_jobs: int | None = None) -> list[EncodeJob]: ...

    async def complete_encode_jobs(self, outcomes: dict[str, bool]) -> int: ...


def _capture_params(job: EncodeJob):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": job.kv_transfer_params()})


def _captured(output: Any) -> bool:
    report = (getattr(output, "kv_transfer_params", None) or {}).get(PARAMS_KEY) or {}
    return bool(report.get("captured"))


def encode_jobs_sync(llm: Any, jobs: Sequence[EncodeJob]) -> dict[str, bool]:
    """Run capture jobs on a synchronous vllm.LLM in one batch; job id -> captured."""
    from vllm.inputs import TokensPrompt

    if not jobs:
        return {}
    prompts = [TokensPrompt(prompt_token_ids=list(job.token_ids)) for job in jobs]
    outputs = llm.generate(prompts, [_capture_params(job) for job in jobs], use_tqdm=False)
    return {job.job_id: _captured(out) for job, out in zip(jobs, outputs)}


async def encode_jobs_async(engine: Any, jobs: Sequence[EncodeJob]) -> dict[str, bool]:
    """Run capture jobs concurrently on an AsyncLLM; job id -> captured (False on engine errors)."""
    from vllm.inputs import TokensPrompt

    async def one(job: EncodeJob) -> bool:
        final = None
        async for output in engine.generate(
            TokensPrompt(prompt_token_ids=list(job.token_ids)), _capture_params(job), request_id=f"encode-{uuid.uuid4().hex}"
        ):
            final = output
        return final is not None and _captured(final)

    results = await asyncio.gather(*(one(job) for job in jobs), return_exceptions=True)
    outcomes = {}
    for job, result in zip(jobs, results):
        if isinstance(result, BaseException):
            logger.warning("encode job %s failed: %s", job.job_id, result)
        outcomes[job.job_id] = result is True
    return outcomes


def _is_sync_llm(engine: Any) -> bool:
    from vllm import LLM

    return isinstance(engine, LLM)


class EncodeDriver:
    """Drains a shard's encode queue through an engine (see the module docstring)."""

    def __init__(
        self, queue: EncodeQueue, engine: Any, batch: int = 32, on_batch: Callable[[int, float], None] | None = None
    ):
        self.queue = queue
        self.engine = engine
        self.batch = batch
        self.on_batch = on_batch  # (facts committed, seconds) after each batch: metrics, progress bars
        self._lock = asyncio.Lock()

    async def drain(self) -> int:
        """Encode until the shard has nothing queued; returns how many entries went live."""
        total = 0
        async with self._lock:
            while True:
                jobs = await self.queue.take_encode_jobs(self.batch)
                if not jobs:
                    return total
                started = time.perf_counter()
                if _is_sync_llm(self.engine):
                    outcomes = encode_jobs_sync(self.engine, jobs)
                else:
                    outcomes = await encode_jobs_async(self.engine, jobs)
                live = await self.queue.complete_encode_jobs(outcomes)
                total += live
                if self.on_batch is not None:
                    self.on_batch(live, time.perf_counter() - started)

    async def run_forever(self, idle_s: float = 0.5) -> None:
        """Background loop: picks up work queued by a restart rebuild or evicted facts in use."""
        while True:
            try:
                if await self.drain() == 0:
                    await asyncio.sleep(idle_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a shard restarting: its calls fail until it is back
                logger.warning("encode loop: %s; retrying", exc)
                await asyncio.sleep(idle_s)
