"""No tenant can fill the store (issue 25), through the running service on its own redis-server.

- an add past a user's quota answers 429 `quota_exceeded` (the quota's setting in `param`, the
  use and limit in the message) and stores nothing, not even its turns; a delete frees quota;
- an add past `add_limits` answers 413 `request_too_large` before anything is stored;
- a write Redis refuses at its maxmemory (policy noeviction) answers 507 `memory_store_full` with
  Retry-After and changes nothing;
- past memory.redis_memory_warn_fraction of maxmemory, /health and /v1/shards carry a warning and
  kvmem_redis_memory_used_ratio says how full Redis is.
The store's side of the same (counters, derivation, a batch checked whole): tests/test_quotas.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import requests

from devtools.local_redis import LocalRedis
from tests.serve_harness import running_service

NAMESPACE = "quota"
PREFIX = f"kvmem-{NAMESPACE}"  # tests.serve_harness.small_service_args
QUOTA = {"max_facts": 3, "max_turns": 4, "max_text_bytes": 4000}
ADD_LIMITS = {"max_turns": 3, "max_turn_chars": 500, "max_facts": 4, "max_fact_chars": 300}


@pytest.fixture(scope="module")
def quota_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """A Redis of its own: these tests move its maxmemory."""
    with LocalRedis(tmp_path_factory.mktemp("quota-redis"), maxmemory="256mb") as server:
        yield server


@pytest.fixture(scope="module")
def service(quota_redis: LocalRedis, smollm2_dir) -> Iterator[str]:
    overrides: dict[str, Any] = {"memory": {"quota": QUOTA}, "add_limits": ADD_LIMITS}
    with running_service(quota_redis.url, smollm2_dir, NAMESPACE, metrics=True, **overrides) as url:
        yield url


def add(service: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{service}/v1/memories", json={"infer": False, **body}, timeout=300)


def stored(client: redis.Redis, user_id: str) -> dict[str, Any]:
    """Everything of the user's in Redis, for a before/after comparison."""
    keys = sorted(client.keys(f"{PREFIX}:user:{user_id}:*"))
    return {key: (client.type(key), client.dump(key)) for key in keys}


def test_an_add_past_a_quota_is_429_and_stores_nothing_and_a_delete_frees_quota(service: str, quota_redis: LocalRedis) -> None:
    client = redis.Redis.from_url(quota_redis.url)
    first = add(service, {"user_id": "gus", "facts": ["Gus keeps bees.", "Gus rows on Sundays."]})
    assert first.status_code == 200, first.text
    before = stored(client, "gus")
    over = add(service, {"user_id": "gus", "facts": ["Gus paints.", "Gus sings."],
                         "turns": [{"turn_id": "t1", "speaker": "gus", "text": "I paint and I sing."}]})
    assert over.status_code == 429, over.text
    error = over.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("quota_exceeded", "memory.quota.max_facts", "rate_limit_error")
    assert "'gus' has 2 of 3 facts" in error["message"] and "would add 2" in error["message"]
    assert stored(client, "gus") == before  # neither the facts nor the turn
    listed = requests.get(f"{service}/v1/memories", params={"user_id": "gus"}, timeout=60).json()["results"]
    assert len(listed) == 2
    assert requests.delete(f"{service}/v1/memories/{first.json()['results'][0]['id']}", timeout=60).status_code == 200
    again = add(service, {"user_id": "gus", "facts": ["Gus paints.", "Gus sings."]})
    assert again.status_code == 200, again.text
    assert client.hgetall(f"{PREFIX}:user:gus:usage")[b"facts"] == b"3"


def test_an_add_past_the_add_limits_is_413_and_stores_nothing(service: str, quota_redis: LocalRedis) -> None:
    client = redis.Redis.from_url(quota_redis.url)
    turn = {"speaker": "hal", "text": "hello"}
    cases = [
        ({"turns": [{**turn, "turn_id": f"t{i}"} for i in range(4)]}, "turns", "at most 3 per add"),
        ({"turns": [{**turn, "turn_id": "t1", "text": "x" * 501}]}, "turns.0.text", "at most 500"),
        ({"facts": ["Hal skis."] * 5}, "facts", "at most 4 per add"),
        ({"facts": ["Hal skis.", "y" * 301]}, "facts.1", "at most 300"),
    ]
    for body, param, says in cases:
        refused = add(service, {"user_id": "hal", **body})
        assert refused.status_code == 413, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("request_too_large", param) and says in error["message"]
    assert stored(client, "hal") == {}  # not even a shard placement


def test_a_write_redis_refuses_for_memory_is_507_and_changes_nothing(service: str, quota_redis: LocalRedis) -> None:
    client = redis.Redis.from_url(quota_redis.url)
    assert add(service, {"user_id": "ida", "facts": ["Ida climbs."]}).status_code == 200
    before = stored(client, "ida")
    limit = client.config_get("maxmemory")["maxmemory"]
    client.config_set("maxmemory", 1)  # Redis is full
    try:
        full = add(service, {"user_id": "ida", "facts": ["Ida dives."],
                             "turns": [{"turn_id": "t1", "speaker": "ida", "text": "I dive."}]})
        newcomer = add(service, {"user_id": "jo", "facts": ["Jo knits."]})  # refused at the ingress's placement
    finally:
        client.config_set("maxmemory", limit)
    for answer in (full, newcomer):
        assert answer.status_code == 507, answer.text
        assert answer.json()["error"]["code"] == "memory_store_full" and answer.headers["Retry-After"] == "60"
    assert stored(client, "ida") == before and stored(client, "jo") == {}
    after = add(service, {"user_id": "ida", "facts": ["Ida dives."]})  # room again: writes go on
    assert after.status_code == 200, after.text


def test_past_the_warning_fraction_health_shards_and_the_metric_say_so(service: str, quota_redis: LocalRedis) -> None:
    client = redis.Redis.from_url(quota_redis.url)
    health = requests.get(f"{service}/health", timeout=30).json()
    assert health["redis_memory"]["max_bytes"] == 256 * 2**20 and "warning" not in health["redis_memory"]
    limit = client.config_get("maxmemory")["maxmemory"]
    client.config_set("maxmemory", int(client.info("memory")["used_memory"] / 0.9))  # 90% full
    try:
        answer = requests.get(f"{service}/health", timeout=30)
        assert answer.status_code == 200 and answer.json()["status"] == "ok"  # a warning, not an outage
        assert "past 80%" in answer.json()["redis_memory"]["warning"]
        deadline, shard, ratio = time.time() + 90, {}, 0.0
        while time.time() < deadline and not ("warning" in shard.get("redis_memory", {}) and ratio >= 0.8):
            shard = requests.get(f"{service}/v1/shards", timeout=60).json()["results"][0]
            text = requests.get(os.environ["KVMEM_TEST_METRICS_URL"], timeout=10).text
            values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if "kvmem_redis_memory_used_ratio" in line and not line.startswith("#")]
            ratio = max(values, default=0.0)
            time.sleep(2)
        assert "past 80%" in shard["redis_memory"]["warning"] and shard["redis_memory"]["fraction"] >= 0.8
        assert ratio >= 0.8, "kvmem_redis_memory_used_ratio did not reach the exported metrics"
    finally:
        client.config_set("maxmemory", limit)
