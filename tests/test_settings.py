"""ServiceSettings: YAML args, environment overrides, validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serve_app.settings import ServiceSettings


def test_environment_overrides_yaml_args_field_by_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMEM_ENGINE__DTYPE", "float32")
    monkeypatch.setenv("REDIS_URL", "redis://example:6379/0")
    settings = ServiceSettings.from_args({"engine": {"dtype": "bfloat16", "max_model_len": 1000}})
    assert settings.engine.dtype == "float32"
    assert settings.engine.max_model_len == 1000  # from YAML, untouched by the env
    assert settings.redis_url == "redis://example:6379/0"


def test_defaults_are_the_embedded_cpu_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    settings = ServiceSettings.from_args(None)
    assert settings.engine.enforce_eager and settings.engine.multiprocess
    assert settings.resolved_model().endswith("SmolLM2-135M-Instruct")


@pytest.mark.parametrize("args", [{"engine": {"dtype": "int3"}}, {"engine": {"max_model_len": 0}}, {"bogus": 1}])
def test_invalid_args_are_rejected(args: dict) -> None:
    with pytest.raises(ValidationError):
        ServiceSettings.from_args(args)


def test_the_app_refuses_to_build_without_redis(monkeypatch) -> None:
    from serve_app.app import build_app

    for name in ("REDIS_URL", "KVMEM_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="redis_url"):
        build_app({})


@pytest.mark.parametrize("config", ["config.yaml", "config.gpu.yaml"])
def test_shipped_serve_configs_are_valid_settings(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each `serve run` config's args are ServiceSettings as they stand (a typo fails here, not at start)."""
    from pathlib import Path

    import yaml

    for name in ("REDIS_URL", "KVMEM_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    doc = yaml.safe_load((Path(__file__).resolve().parent.parent / config).read_text())
    (app,) = doc["applications"]
    assert app["import_path"] == "serve_app.app:build_app"
    settings = ServiceSettings.from_args(app["args"])
    if config == "config.gpu.yaml":
        assert not settings.engine.enforce_eager and settings.memory.arena.device_pages == "auto"
        assert settings.engine.gpu_memory_utilization == "auto" and settings.gpu.sequence_tokens  # the card's memory plan sizes both
        assert settings.llm_replica_num_gpus + settings.shard_num_gpus <= 1 and settings.auth.mode == "keys"
        # what bench/serve/serve_http.py found the GPU needs: events batched, no router hop, a full batch admitted
        assert settings.engine.stream_interval > 1 and settings.routing == "direct"
        assert settings.llm_replica_max_ongoing_requests >= settings.engine.max_num_seqs


def test_make_serve_announces_the_app_once_its_health_says_ok() -> None:
    """devtools.announce_ready: the config's proxy address, and a report only once status is ok."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from pathlib import Path

    from devtools.announce_ready import health_url, wait_until_healthy

    root = Path(__file__).resolve().parent.parent
    assert health_url(root / "config.yaml") == "http://127.0.0.1:8000/health"
    assert health_url(root / "config.gpu.yaml") == "http://127.0.0.1:8000/health"  # 0.0.0.0 is reached on loopback
    answers = iter([(503, {"status": "degraded"}), (200, {"status": "ok", "redis": "ok"})])

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            code, body = next(answers, (200, {"status": "ok", "redis": "ok"}))
            self.send_response(code)
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/health"
        assert wait_until_healthy(url, timeout_s=20, poll_s=0.05) == {"status": "ok", "redis": "ok"}
        assert wait_until_healthy("http://127.0.0.1:9/health", timeout_s=0.3, poll_s=0.05) is None  # nothing listens
    finally:
        server.shutdown()


def test_make_serve_reports_a_failed_deployment_from_serves_status(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """devtools.announce_ready.deploy_failure: Serve's application status (the dashboard's
    /api/serve/applications/, what `serve status` reads) with Ray's token; None until DEPLOY_FAILED."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from devtools.announce_ready import deploy_failure

    message = "memory plan refused: ... on a 24.0 GiB stated card ..."
    states = iter(["DEPLOYING", "DEPLOY_FAILED"])
    seen: list[str] = []

    class Dashboard(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append(f"{self.path} {self.headers.get('Authorization')}")
            state = next(states, "DEPLOY_FAILED")
            deployments = {"LLMReplica": {"status": state if state == "DEPLOY_FAILED" else "UPDATING", "message": message}}
            body = {"applications": {"kvmem": {"status": state, "message": "Failed to update the deployments ['LLMReplica'].",
                                               "deployments": deployments}}}
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

        def log_message(self, *args) -> None:
            pass

    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    (tmp_path / "token").write_text("tok-123\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), Dashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dashboard = f"http://127.0.0.1:{server.server_address[1]}"
        assert deploy_failure(dashboard, "kvmem") is None  # still deploying
        failure = deploy_failure(dashboard, "kvmem")
        assert failure is not None and "Failed to update" in failure and f"LLMReplica: {message}" in failure
        assert deploy_failure(dashboard, "other-app") is None
        assert seen[0] == "/api/serve/applications/ Bearer tok-123"
        assert deploy_failure("http://127.0.0.1:9", "kvmem") is None  # no dashboard (yet): no verdict
    finally:
        server.shutdown()


def test_auto_dtype_is_float32_only_on_cpus_without_native_bf16() -> None:
    from serve_app.replica.engine import cpu_has_native_bf16

    assert not cpu_has_native_bf16("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")  # this machine's kind
    assert cpu_has_native_bf16("flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n")  # Sapphire Rapids
    assert cpu_has_native_bf16("Features\t: fp asimd bf16 i8mm\n")  # Arm Neoverse V1


def test_engine_kwargs_carry_stream_interval_and_load_format_only_when_set() -> None:
    """engine.stream_interval (tokens per streamed event after the first) and engine.load_format
    reach vLLM's engine arguments; the defaults leave vLLM's own defaults alone."""
    from serve_app.replica.engine import engine_kwargs
    from serve_app.settings import EngineSettings

    plain = engine_kwargs(EngineSettings(dtype="float32"), "/m")
    assert "stream_interval" not in plain and "load_format" not in plain
    gpu = engine_kwargs(EngineSettings(dtype="bfloat16", stream_interval=8, load_format="dummy"), "/m")
    assert gpu["stream_interval"] == 8 and gpu["load_format"] == "dummy" and gpu["dtype"] == "bfloat16"


def test_batch_invariant_sets_vllms_switch_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.batch_invariant: VLLM_BATCH_INVARIANT=1 in the environment the engine (and its core
    subprocess) starts with; off by default."""
    import os

    from serve_app.replica.engine import prepare_environment
    from serve_app.settings import EngineSettings

    # setenv (not delenv, which records nothing for an absent name) so that monkeypatch removes
    # what prepare_environment sets: a leaked VLLM_BATCH_INVARIANT=1 breaks every later CPU engine
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):  # what it sets, restored afterwards
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    prepare_environment(EngineSettings(dtype="float32"))
    assert os.environ["VLLM_BATCH_INVARIANT"] == "0"
    prepare_environment(EngineSettings(dtype="float32", batch_invariant=True))
    assert os.environ["VLLM_BATCH_INVARIANT"] == "1"
    # (not read back through vllm.envs here: vLLM caches what it read, and every later in-process
    # engine of this pytest process would then run batch-invariant kernels, which CPUs lack)


@pytest.mark.parametrize(
    ("model", "given", "served"),
    [
        (None, "", "smollm2-135m-instruct"),  # the embedded default
        ("/root/.cache/kvmem/models/SmolLM2-135M-Instruct", "", "smollm2-135m-instruct"),  # its converted folder
        ("meta-llama/Llama-3.1-8B-Instruct", "", "meta-llama/Llama-3.1-8B-Instruct"),  # a hub id, as vLLM names it
        ("/models/Qwen3-8B/", "", "Qwen3-8B"),  # a folder: its name, decided by spelling (the same on every node)
        ("./weights/Mistral-7B", "", "Mistral-7B"),
        ("meta-llama/Llama-3.1-8B-Instruct", "llama", "llama"),  # an explicit name wins
    ],
)
def test_the_served_model_name_follows_the_model(model: str | None, given: str, served: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVMEM_SERVED_MODEL_NAME", raising=False)
    settings = ServiceSettings(engine={"model": model}, served_model_name=given)
    assert settings.served_model_name == served
