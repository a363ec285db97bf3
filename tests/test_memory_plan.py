"""The card's memory plan (gpuplan.plan), on the CPU: cards of 24, 48, 80 and 141 GiB x SmolLM2-135M,
the Llama-3.1-8B shape and the Llama-3.1-70B shape over tensor parallelism, one and two replicas per
card. Every plan stays within its card, gives the engine at least what vLLM needs (weights,
activations, KV for max_num_seqs sequences), and a refusal names the numbers and the settings.

The model configs are in tests/model_configs/: SmolLM2's own config.json, bench/engine's 8B one,
and the 70B one written from the published Llama-3.1-70B architecture (80 layers, hidden 8192, 64
heads, 8 KV heads of 128, intermediate 28672, vocabulary 128256, untied embeddings).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from gpuplan.model_shape import ModelShape
from gpuplan.plan import Card, GiB, MemoryPlan, PlanInputs, PlanRefused, activation_bytes, free_memory_refusal, plan_memory
from gpuplan.settings import GpuPlanSettings

CONFIGS = Path(__file__).resolve().parent / "model_configs"
REPO = Path(__file__).resolve().parent.parent
MODELS = {name: ModelShape.from_config(json.loads((CONFIGS / f"{name}.json").read_text()), name=name)
          for name in ("smollm2_135m", "llama31_8b", "llama31_70b")}
H100 = 79.18  # GiB an H100 80 GB reports usable (measured, issue 34)


def inputs(model: str, tp: int = 1, rpc: int = 1, **overrides) -> PlanInputs:
    """config.gpu.yaml's serving shape: 256 sequences of 1536 tokens, context 8192, CUDA graphs,
    a 6144-page host tier, the shard on the card."""
    base = dict(shape=MODELS[model], dtype="bfloat16", max_num_seqs=256, max_model_len=8192, sequence_tokens=1536,
                block_size=64, tensor_parallel_size=tp, host_pages=6144, replicas_per_card=rpc, shard_on_card=True)
    return PlanInputs(**{**base, **overrides})


def card(gib: float) -> Card:
    return Card(total_bytes=int(gib * GiB), free_bytes=int(gib * GiB), name=f"{gib:g} GiB card", source="test")


def test_the_model_shapes_match_the_published_sizes() -> None:
    small, eight, seventy = MODELS["smollm2_135m"], MODELS["llama31_8b"], MODELS["llama31_70b"]
    assert round(small.parameters() / 1e6) == 135 and small.tied
    assert round(eight.parameters() / 1e9, 2) == 8.03 and not eight.tied
    assert round(seventy.parameters() / 1e9, 1) == 70.6
    assert small.kv_bytes_per_token("bfloat16") == 2 * 30 * 3 * 64 * 2  # 22.5 KiB
    assert eight.kv_bytes_per_token("bfloat16") == 128 * 1024  # what config.gpu.yaml's arena comment says
    assert seventy.kv_bytes_per_token("bfloat16") == 320 * 1024
    # tensor parallelism splits KV heads and weights; past the KV heads vLLM replicates one per card
    assert seventy.kv_bytes_per_token("bfloat16", tp=2) == 160 * 1024
    assert seventy.kv_heads_per_card(16) == 1
    assert seventy.weight_bytes("bfloat16", tp=4) == -(-seventy.parameters() * 2 // 4)


# (card GiB, model, tensor_parallel_size, replicas per card) -> fits?
EXPECTED = {
    (24, "smollm2_135m", 1, 1): True, (24, "smollm2_135m", 1, 2): False,  # 2 x (KV 8.4 + shard 3 + graphs 2.5) > 24
    (24, "llama31_8b", 1, 1): False,  # 15 GiB of weights + 48 GiB of KV for 256 x 1536
    (24, "llama31_70b", 1, 1): False, (24, "llama31_70b", 4, 1): False,  # 131 GiB of weights; 33 a card at tp 4
    (48, "smollm2_135m", 1, 2): True, (48, "llama31_8b", 1, 1): False,
    (80, "smollm2_135m", 1, 2): True, (80, "llama31_8b", 1, 1): True, (80, "llama31_8b", 1, 2): False,
    (80, "llama31_70b", 1, 1): False, (80, "llama31_70b", 2, 1): False, (80, "llama31_70b", 4, 1): True,
    (141, "llama31_8b", 1, 1): True, (141, "llama31_70b", 1, 1): False, (141, "llama31_70b", 2, 1): True,
    (141, "llama31_70b", 4, 2): False,
}
CASES = [(gib, model, tp, rpc) for gib in (24, 48, 80, 141) for model in MODELS
         for tp in ((1, 2, 4) if model == "llama31_70b" else (1,)) for rpc in (1, 2)]


def check_within_card(plan: MemoryPlan, data: PlanInputs) -> None:
    slice_bytes = plan.card.total_bytes // plan.replicas_per_card
    parts = plan.engine_bytes + plan.engine_overhead_bytes + plan.tier_bytes + plan.shard_bytes + plan.margin_bytes
    assert parts + plan.unused_bytes == slice_bytes and plan.unused_bytes >= 0
    assert plan.replicas_per_card * parts <= plan.card.total_bytes
    # vLLM's share is a fraction of the total and covers weights, activations and KV for max_num_seqs sequences
    assert 0 < plan.gpu_memory_utilization <= 1 and plan.engine_bytes == int(plan.gpu_memory_utilization * plan.card.total_bytes)
    assert plan.engine_bytes >= plan.weights_bytes + plan.activation_bytes + plan.kv_min_bytes
    assert plan.kv_tokens >= data.max_num_seqs * data.sequence_tokens and plan.kv_tokens >= data.max_model_len
    assert plan.weights_bytes == data.shape.weight_bytes("bfloat16", data.tensor_parallel_size)
    assert plan.activation_bytes == activation_bytes(data)
    assert 0 <= plan.device_pages <= data.host_pages
    assert plan.tier_bytes == plan.device_pages * data.page_tokens * data.shape.kv_bytes_per_token("bfloat16")


def check_refusal(message: str, gib: float) -> None:
    assert message.startswith("memory plan refused")
    assert f"{gib:.1f} GiB" in message  # the card
    for part in ("weights", "activations", "KV", "CUDA graphs", "HBM tier", "memory shard", "margin", "GiB over"):
        assert part in message, part
    for setting in ("engine.max_num_seqs", "gpu.sequence_tokens", "memory.arena.device_pages",
                    "engine.gpu_memory_utilization", "shard_num_gpus", "llm_replica_num_gpus", "tensor_parallel_size"):
        assert setting in message, setting


@pytest.mark.parametrize(("gib", "model", "tp", "rpc"), CASES)
def test_every_plan_fits_its_card_or_is_refused_with_the_numbers(gib: int, model: str, tp: int, rpc: int) -> None:
    data = inputs(model, tp, rpc)
    try:
        plan = plan_memory(card(gib), data)
    except PlanRefused as refused:
        assert EXPECTED.get((gib, model, tp, rpc), False) is False, str(refused)
        check_refusal(str(refused), gib)
        if rpc > 1:
            assert f"shared by {rpc} replicas" in str(refused)
        return
    assert EXPECTED.get((gib, model, tp, rpc), True) is True, plan.summary()
    check_within_card(plan, data)
    # auto: the HBM tier takes what is left up to the whole host tier, then the engine's KV the rest
    assert plan.device_pages == data.host_pages or plan.unused_bytes < plan.card.total_bytes * 0.001 + GiB


def test_the_8b_shape_on_an_h100_matches_the_measured_start() -> None:
    """config.gpu.yaml's shape on the H100 of issue 34 (79.18 GiB): the plan fits with an HBM tier of
    about what the fixed settings gave it (4096 pages, 8 GiB), and its reserves cover what the start
    measured there: the engine process 48-50 GiB with vLLM at 0.5 and 4096 pages, the shard 0.6-2.7 GiB."""
    plan = plan_memory(card(H100), inputs("llama31_8b"))
    assert 0.75 < plan.gpu_memory_utilization < 0.85 and 3500 < plan.device_pages < 4500
    measured = plan_memory(card(H100), inputs("llama31_8b", gpu_memory_utilization=0.5, device_pages=4096, sequence_tokens=512))
    assert measured.engine_process_bytes >= 50 * GiB  # 39.6 vLLM + 8 HBM tier + graphs and context: at most 50 measured
    assert measured.shard_bytes >= 2.7 * GiB
    assert "explicit: engine.gpu_memory_utilization 0.5, memory.arena.device_pages 4096" in measured.summary()


def test_explicit_values_win_and_are_checked_against_the_card() -> None:
    data = inputs("llama31_8b", gpu_memory_utilization=0.5, device_pages=4096)  # the old fixed settings, 256 x 1536
    with pytest.raises(PlanRefused, match=r"engine.gpu_memory_utilization 0.5 gives the engine 39.6 GiB of 79.2, 24.6 GiB short"):
        plan_memory(card(H100), data)
    pages = plan_memory(card(H100), inputs("llama31_8b", device_pages=1000))
    assert pages.device_pages == 1000 and pages.gpu_memory_utilization > 0.85  # the engine's KV gets the rest
    with pytest.raises(PlanRefused, match=r"the HBM tier 97.7 \(50000 pages\)") as refused:
        plan_memory(card(H100), inputs("llama31_8b", device_pages=50000, host_pages=65536))  # forced beyond the card
    check_refusal(str(refused.value), H100)
    capped = plan_memory(card(141), inputs("smollm2_135m", device_pages=10**6))
    assert capped.device_pages == 6144  # the HBM tier never holds more than the host tier's pages


def test_replicas_on_one_card_split_it() -> None:
    one = plan_memory(card(80), inputs("smollm2_135m"))
    two = plan_memory(card(80), inputs("smollm2_135m", rpc=2))
    assert two.gpu_memory_utilization < one.gpu_memory_utilization / 2
    assert 2 * (two.engine_process_bytes + two.shard_bytes + two.margin_bytes) <= two.card.total_bytes


def test_the_typical_sequence_decides_the_kv_minimum() -> None:
    """max_model_len as the sequence (no gpu.sequence_tokens): 256 x 8192 tokens of 8B KV is 256 GiB."""
    with pytest.raises(PlanRefused, match=r"KV 256.0 for 256 sequences x 8192 tokens"):
        plan_memory(card(141), inputs("llama31_8b", sequence_tokens=8192))
    fewer = plan_memory(card(141), inputs("llama31_8b", sequence_tokens=8192, max_num_seqs=32))
    assert fewer.kv_tokens >= 32 * 8192


def test_an_eager_engine_reserves_no_graphs() -> None:
    graphs = plan_memory(card(24), inputs("smollm2_135m"))
    eager = plan_memory(card(24), inputs("smollm2_135m", cuda_graphs=False))
    assert eager.engine_overhead_bytes == int(GpuPlanSettings().eager_overhead_gib * GiB) < graphs.engine_overhead_bytes


def test_a_card_held_by_another_process_is_refused_at_start() -> None:
    """The H100 start of issue 34: JAX had taken 60 GiB, vLLM found 18.64 of 79.18 GiB free."""
    plan = plan_memory(card(H100), inputs("llama31_8b"))
    message = free_memory_refusal(plan, int(18.64 * GiB), waited_s=10)
    assert message is not None and "18.6 GiB free of 79.2" in message and "JAX" in message
    assert "engine.max_num_seqs" in message and "nvidia-smi" in message
    assert free_memory_refusal(plan, plan.engine_process_bytes, waited_s=0) is None


def test_the_plan_report_is_in_gib_and_pages() -> None:
    report = plan_memory(card(80), inputs("llama31_8b")).as_dict()
    assert report["card"]["total_gib"] == 80.0 and report["hbm_tier"]["pages"] > 0
    assert report["engine"]["sequences"] == "256 x 1536 tokens" and report["engine"]["kv_gib"] >= report["engine"]["kv_min_gib"]
    assert re.fullmatch(r"\d+\.\d+", str(report["engine"]["gpu_memory_utilization"]))


# ---------------------------------------------------------------- from the service's settings
def model_folder(tmp_path: Path, name: str) -> str:
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(CONFIGS / f"{name}.json", folder / "config.json")
    return str(folder)


def gpu_yaml_args() -> dict:
    return yaml.safe_load((REPO / "config.gpu.yaml").read_text())["applications"][0]["args"]


def test_config_gpu_yaml_fits_the_8b_shape_on_an_h100_and_an_h200(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from serve_app.card_plan import plan_for, replicas_per_card
    from serve_app.settings import ServiceSettings

    monkeypatch.delenv("REDIS_URL", raising=False)
    settings = ServiceSettings.from_args(gpu_yaml_args())
    assert replicas_per_card(settings) == 2  # 2 x 0.45 + 0.1 of one card: the shard's two replicas and the shard
    model = model_folder(tmp_path, "llama31_8b")
    for gib in (H100, 139.8):
        plan = plan_for(settings, model, "bfloat16", card(gib))
        assert plan.device_pages > 0 and plan.shard_bytes > 0 and plan.kv_tokens >= settings.engine.max_num_seqs * 1536
    with pytest.raises(PlanRefused, match="24.0 GiB"):
        plan_for(settings, model, "bfloat16", card(24))


@pytest.mark.parametrize(("llm", "shard", "replicas", "per_shard", "per_card"), [
    (0.9, 0.1, 1, 1, 1), (0.4, 0.1, 2, 1, 2), (0.45, 0.05, 1, 1, 1), (0.3, 0.0, 4, 1, 3), (2, 0.0, 2, 1, 1), (0, 0, 2, 1, 1),
    (0.45, 0.1, 1, 2, 2), (0.2, 0.1, 2, 2, 4), (0.4, 0.1, 2, 2, 2),  # a shard's replicas share one shard on the card
])
def test_replicas_per_card_follow_the_gpu_fractions(llm: float, shard: float, replicas: int, per_shard: int, per_card: int) -> None:
    from serve_app.card_plan import replicas_per_card
    from serve_app.settings import ServiceSettings

    settings = ServiceSettings(llm_replica_num_gpus=llm, shard_num_gpus=shard, llm_replicas=replicas, llm_replicas_per_shard=per_shard)
    assert replicas_per_card(settings) == per_card


def test_the_builder_refuses_a_plan_that_does_not_fit_before_anything_deploys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu.card_gib states the card (on a GPU machine NVML reads it): `serve run` ends at the build."""
    from serve_app.app import build_app

    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # never connected to
    args = gpu_yaml_args()
    args["engine"]["model"] = model_folder(tmp_path, "llama31_8b")
    args["gpu"]["card_gib"] = 24
    with pytest.raises(PlanRefused, match=r"memory plan refused: llama31_8b \(bfloat16, tensor_parallel_size 1\) on a 24.0 GiB"):
        build_app(args)
    args["gpu"]["card_gib"] = H100
    args["memory"]["arena"]["device_pages"] = 50000  # forced beyond the card
    args["memory"]["arena"]["num_pages"] = 65536
    with pytest.raises(PlanRefused, match=r"50000 pages"):
        build_app(args)
    args["memory"]["arena"]["device_pages"] = "auto"
    assert build_app(args) is not None
