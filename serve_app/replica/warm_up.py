"""The engine's one-time costs paid when the replica starts, not in a client's first request.

vLLM compiles (torch.compile, inductor) the sampler's rank kernel for logprobs
(vllm.v1.sample.ops.logprobs.batched_count_greater_than) on the first request that asks for
logprobs: seconds for the first chat with `logprobs` on a CPU, tenths of a second for later ones (issue
37, docs/measured.md). One one-token generation with logprobs (sampled at temperature 1, so a sampling kernel compiled on first use,
vllm.v1.sample.ops.topk_topp_sampler.compiled_random_sample where a platform uses it, is paid too), sent at
the encoder's priority as soon as an engine is up (at the replica's start, and again when the engine
is rebuilt in place: serve_app.replica.lifecycle.EngineKeeper), pays it before clients come.
Measured by `python -m bench.api.logprobs_cold_start` at commit 8b44f8c (retired in issue 35; docs/measured.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from serve_app.replica.scheduling import ENCODE_PRIORITY

logger = logging.getLogger(__name__)


async def warm_up(engine: Any, prompt_ids: list[int], timeout_s: float) -> float | None:
    """One one-token request with logprobs on `engine`; its seconds, or None when it failed or ran
    past timeout_s (logged: the cost then falls on the first client request, as without it)."""
    from vllm import SamplingParams  # the replica's process boundary (serve_app.replica.server)
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, logprobs=1, temperature=1.0, seed=0)
    started = time.perf_counter()

    async def run() -> None:
        generated = engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, request_id=f"warm-up-{uuid.uuid4().hex}", priority=ENCODE_PRIORITY)
        async for _ in generated:
            pass

    try:
        await asyncio.wait_for(run(), timeout_s)
    except Exception as exc:  # noqa: BLE001 - a failed warm-up only leaves the cost to the first request
        logger.warning("engine warm-up (logprobs) failed after %.1f s: %s: %s", time.perf_counter() - started, type(exc).__name__, exc)
        return None
    seconds = time.perf_counter() - started
    logger.info("engine warm-up (logprobs, sampling) took %.1f s", seconds)
    return seconds


class WarmUps:
    """Warms each engine the replica gets once (the first at start, each rebuilt one after)."""

    def __init__(self, prompt_ids: list[int], timeout_s: float, enabled: bool = True) -> None:
        self.enabled = enabled  # engine.warm_up
        self.prompt_ids = prompt_ids
        self.timeout_s = timeout_s
        self._warmed: Any = None
        self.task: asyncio.Task | None = None
        self.seconds: float | None = None

    def ensure(self, engine: Any) -> None:
        """Starts the warm-up of `engine` unless it was started already; needs a running event loop
        (without one, nothing happens and a later call starts it)."""
        if not self.enabled or engine is None or engine is self._warmed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._warmed = engine
        self.task = loop.create_task(self._run(engine))

    async def _run(self, engine: Any) -> None:
        self.seconds = await warm_up(engine, self.prompt_ids, self.timeout_s)
