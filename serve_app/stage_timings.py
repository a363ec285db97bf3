"""Per-request stage timings of the chat path, as Prometheus histograms and in the answer.

Every chat request records, in milliseconds, where its time went before the first token:
on the replica `prepare` (all work before the engine: the shard's plan or the chat template),
`plan_call` (the round trip to the memory shard actor: its plan channel, or Ray when that
does not answer), inside the shard `shard_embed`, `shard_search` and `shard_compose`,
`shard_hop` (plan_call minus the shard's own work: the hop and serialisation), `engine_ttft` (engine.generate to the first token) and
`replica_ttft` (replica entry to the first token); on the ingress `auth`, `route` and
`replica_first_event` (the handle call to the first streamed event). The replica's stages go
into the answer's `timings` field, the ingress's into a standard `Server-Timing` header, and
both into `kvmem_stage_seconds{stage}` (bench/serve/serve_http.py reads all three).
"""

from __future__ import annotations

import time

from ray.serve.metrics import Counter, Histogram

# 0.1 ms .. 10 s: the stages of one request on a GPU are tenths of a millisecond to tens
STAGE_BOUNDARIES_S = [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 10]


def count_positive(counter: Counter, value: float) -> None:
    """Counter.inc refuses 0 (ray.util.metrics); skip empty increments."""
    if value > 0:
        counter.inc(value)


def stage_histogram() -> Histogram:
    return Histogram(
        "kvmem_stage_seconds",
        description="Time per stage of a chat request before its first token (serve_app.stage_timings).",
        boundaries=STAGE_BOUNDARIES_S,
        tag_keys=("stage",),
    )


class StageClock:
    """Stage durations (ms) of one request, measured from one start with perf_counter."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.started_at = time.time()  # the same instant on the wall clock (Server-Timing `started`)
        self.stages: dict[str, float] = {}

    def since(self, start: float) -> float:
        """Milliseconds from `start` (a perf_counter reading) to now."""
        return (time.perf_counter() - start) * 1e3

    def record(self, stage: str, start: float) -> float:
        """Records `stage` as lasting from `start` to now; returns now."""
        now = time.perf_counter()
        self.stages[stage] = (now - start) * 1e3
        return now

    def add(self, stages: dict[str, float]) -> None:
        self.stages.update(stages)

    def rounded(self) -> dict[str, float]:
        return {stage: round(ms, 3) for stage, ms in self.stages.items()}

    def observe(self, histogram: Histogram) -> None:
        for stage, ms in self.stages.items():
            histogram.observe(ms / 1e3, tags={"stage": stage})

    def server_timing(self) -> str:
        """The stages as an HTTP Server-Timing header value (W3C: `name;dur=ms, ...`), and when the
        clock started (`started;desc="<unix seconds>"`): a client on the same host splits its own
        time to the first byte into before the handler and after it (bench.serve.http_measures.stream_once)."""
        stages = ", ".join(f"{stage};dur={ms:.3f}" for stage, ms in self.stages.items())
        return f'{stages}, started;desc="{self.started_at:.6f}"'

