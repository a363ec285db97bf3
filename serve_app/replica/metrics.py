"""ReplicaMetrics: the Prometheus series an LLM replica exports (ray.serve.metrics), in one place.

Chats and text completions by outcome, time to first token, generated and injected tokens, fact
encodes, shard restarts, and the shard's statistics as gauges (export_shard_stats, from the
statistics the replica reads every 10 s). Stage timings are serve_app.stage_timings'.
"""

from __future__ import annotations

from typing import Any

from ray.serve.metrics import Counter, Gauge, Histogram

from serve_app.stage_timings import count_positive, stage_histogram

_TTFT_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]


class ReplicaMetrics:
    """The replica's series (module docstring)."""

    def __init__(self) -> None:
        self.ttft = Histogram("kvmem_ttft_seconds", description="Engine time to first token.", boundaries=_TTFT_BOUNDARIES_S, tag_keys=("mode",))
        self.stage_seconds = stage_histogram()
        self.requests = Counter("kvmem_requests_total", description="Chat and text-completion requests by outcome.", tag_keys=("outcome",))
        self.generated_tokens = Counter("kvmem_generated_tokens_total", description="Tokens generated.")
        self.injected_tokens = Counter("kvmem_injected_tokens_total", description="Prompt tokens supplied by KV injection.")
        self.facts_encoded = Counter("kvmem_facts_encoded_total", description="Fact KV entries captured.")
        self.encode_seconds = Counter("kvmem_encode_seconds_total", description="Engine time spent encoding facts.")
        self.arena_bytes = Gauge("kvmem_arena_bytes", description="Fact KV bytes held, by tier.", tag_keys=("tier", "shard"))
        self.facts = Gauge("kvmem_facts", description="Facts held by the shard.", tag_keys=("shard",))
        self.shard_restarts = Counter("kvmem_shard_restarts_total", description="Shard actors restarted for not answering.")
        self.pending = Gauge("kvmem_pending_encodes", description="Facts waiting for their KV.", tag_keys=("shard",))
        self.facts_with_kv = Gauge("kvmem_facts_with_kv", description="Facts whose KV is live.", tag_keys=("shard",))
        self.redis_memory_ratio = Gauge("kvmem_redis_memory_used_ratio", description="Redis used_memory / maxmemory (writes refused at 1).")
        self.evictions = Gauge("kvmem_kv_evictions", description="Fact KV entries evicted for room since the shard started.", tag_keys=("shard",))

    def encoded(self, live: int, seconds: float) -> None:
        """One encode batch: `live` facts' KV captured in `seconds` of engine time."""
        count_positive(self.facts_encoded, live)
        count_positive(self.encode_seconds, seconds)

    def export_shard_stats(self, stats: dict[str, Any], shard_id: int) -> None:
        shard = str(shard_id)
        self.arena_bytes.set(stats["host_bytes_used"], tags={"tier": "host", "shard": shard})
        self.arena_bytes.set(stats["device_bytes_used"], tags={"tier": "device", "shard": shard})
        self.facts.set(stats["facts"], tags={"shard": shard})
        self.pending.set(stats["pending_encodes"], tags={"shard": shard})
        self.facts_with_kv.set(stats["facts_with_kv"], tags={"shard": shard})
        self.evictions.set(stats["kv_evictions_total"], tags={"shard": shard})
        if stats.get("redis_memory", {}).get("fraction") is not None:
            self.redis_memory_ratio.set(stats["redis_memory"]["fraction"])
