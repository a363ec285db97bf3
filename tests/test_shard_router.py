"""UserShardRouter (serve_app.ingress.shard_router) with Ray Serve's own request objects: a shard hint
goes only to that shard's replica (or waits), a user id to its stable-hash shard, and a replica
that has not published its shard is never chosen for a strict hint.

The candidates are stand-ins carrying the two properties the router reads (Serve's
RunningReplica looks its actor up when built); tests/test_direct_routing.py routes through
Serve's real replicas."""

from __future__ import annotations

import asyncio

from dataclasses import dataclass
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from memory.redis_keys import stable_shard
from serve_app.ingress.shard_router import UserShardRouter
from serve_app.shard_routing import replica_metadata, shard_hint, wanted_shard

DEPLOYMENT = DeploymentID(name="LLMReplica", app_name="kvmem")


@dataclass
class Candidate:
    replica_id: ReplicaID
    replica_metadata: dict[str, Any]


def _replica(tag: str, metadata: dict) -> Any:
    return Candidate(ReplicaID(unique_id=tag, deployment_id=DEPLOYMENT), metadata)


def _choose(replicas: list[Any], session_id: str) -> list[list[str]]:
    async def run() -> list[list[str]]:
        router = UserShardRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.PROXY)
        request = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(request_id="r", internal_request_id="i", session_id=session_id))
        ranks = await router.choose_replicas(replicas, request)
        assert request.routing_context.should_backoff  # a wait backs off instead of spinning
        return [[r.replica_id.unique_id for r in rank] for rank in ranks]

    return asyncio.run(run())


def test_wanted_shard_reads_hints_and_user_ids() -> None:
    assert wanted_shard(shard_hint(3), 4) == (3, True)
    assert wanted_shard("alice", 4) == (stable_shard("alice", 4), False)
    assert wanted_shard("", 4) == (None, False)
    assert wanted_shard("shard:x", 4) == (None, False)
    assert wanted_shard("alice", 0) == (None, False)  # no replica published the shard count yet
    assert wanted_shard(shard_hint(1), 0) == (1, True)  # ... while a forwarded call waits for its replica
    # a client's header naming no shard must not make its request wait forever
    assert wanted_shard(shard_hint(4), 4) == (None, False)
    assert wanted_shard("shard:-1", 4) == (None, False)


def test_shard_hint_goes_to_that_shard_only() -> None:
    replicas = [_replica("a", replica_metadata(0, 2)), _replica("b", replica_metadata(1, 2))]
    assert _choose(replicas, shard_hint(1)) == [["b"]]
    assert _choose(replicas, shard_hint(0)) == [["a"]]
    # shard 1's replica is down or has not published its shard: the call waits, never lands on shard 0
    assert _choose([replicas[0], _replica("c", {})], shard_hint(1)) == []
    assert _choose(replicas, shard_hint(7)) == [["a", "b"]]  # no such shard: anywhere, no wait


def test_user_id_goes_to_its_stable_shard_else_anywhere() -> None:
    replicas = [_replica("a", replica_metadata(0, 2)), _replica("b", replica_metadata(1, 2))]
    users = {stable_shard(f"user-{i}", 2): f"user-{i}" for i in range(20)}
    assert _choose(replicas, users[0]) == [["a"]]
    assert _choose(replicas, users[1]) == [["b"]]
    # its shard's replica is not up: any replica takes it (the ingress routes forward it)
    assert _choose([replicas[0]], users[1]) == [["a"]]
    assert _choose(replicas, "") == [["a", "b"]]


def test_a_shards_replicas_share_its_users_and_one_whose_engine_died_is_avoided() -> None:
    """Two replicas per shard (llm_replicas_per_shard: 2): a user's requests may go to either; a
    replica whose engine died passes its shard's calls to the others (`shard:<n>:avoid:<itself>`),
    which never come back to it, and wait while it is the only one."""
    replicas = [_replica("a0", replica_metadata(0, 2)), _replica("b", replica_metadata(1, 2)), _replica("a1", replica_metadata(0, 2))]
    users = {stable_shard(f"user-{i}", 2): f"user-{i}" for i in range(20)}
    assert _choose(replicas, users[0]) == [["a0", "a1"]]
    assert _choose(replicas, shard_hint(0)) == [["a0", "a1"]]
    assert wanted_shard(shard_hint(0, avoid="a0"), 2) == (0, True)
    assert _choose(replicas, shard_hint(0, avoid="a0")) == [["a1"]]
    assert _choose(replicas[:2], shard_hint(0, avoid="a0")) == []  # no other replica of shard 0 yet: wait
