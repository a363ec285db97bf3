"""How a request names the shard (and the replica to avoid) it must reach, and how a replica says
which shard it serves: the session ids and replica metadata that serve_app.ingress.shard_router's
UserShardRouter reads. Shared by the ingress (which routes) and the replica (which publishes its
shard, and passes a chat on to the shard's other replicas when its engine is down)."""

from __future__ import annotations

from typing import Any

from memory.redis_keys import stable_shard

SHARD_KEY = "shard"  # replica metadata: the shard a replica serves
SHARDS_KEY = "shards"  # replica metadata: how many shards the service has
_SHARD_HINT = "shard:"
_AVOID = ":avoid:"


def shard_hint(shard: int, avoid: str | None = None) -> str:
    """The session id that sends a call to shard `shard`'s replicas (and only there), but the
    replica whose unique id is `avoid`."""
    return f"{_SHARD_HINT}{shard}" + (f"{_AVOID}{avoid}" if avoid else "")


def avoided_replica(session_id: str) -> str | None:
    """The replica a `shard:<n>:avoid:<replica>` hint leaves out, else None."""
    if session_id.startswith(_SHARD_HINT) and _AVOID in session_id:
        return session_id.split(_AVOID, 1)[1]
    return None


def replica_metadata(shard: int, shards: int) -> dict[str, Any]:
    """What a replica publishes to the routers (Serve's record_replica_metadata)."""
    return {SHARD_KEY: shard, SHARDS_KEY: shards}


def wanted_shard(session_id: str, num_shards: int) -> tuple[int | None, bool]:
    """(shard, strict) for a request's session id: strict when the shard is an explicit hint."""
    if not session_id:
        return None, False
    if session_id.startswith(_SHARD_HINT):
        try:
            shard = int(session_id[len(_SHARD_HINT):].split(_AVOID)[0])
        except ValueError:
            return None, False
        # a hint naming no shard (a client can send any session id) goes anywhere instead of waiting
        # forever; until the replicas have published the shard count, a hint waits for its replica
        if shard < 0 or (num_shards > 0 and shard >= num_shards):
            return None, False
        return shard, True
    return (stable_shard(session_id, num_shards) if num_shards > 0 else None), False
