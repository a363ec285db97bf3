"""UserShardRouter: Ray Serve's request router, sending a request to the replica of its shard.

Used by the `routing: direct` topology (serve_app.replica.direct_ingress), where each LLM replica is
its own HTTP ingress and no router deployment stands between Serve's proxy and the engine.
The router runs wherever a handle routes to those replicas: in Serve's proxy (HTTP requests)
and in each replica (a request forwarded to the shard that holds its user).

The hint is the request's session id (`RequestMetadata.session_id`):
  * `shard:<n>` (set by a replica forwarding to shard n): only a replica of shard n takes it;
    while none is up the request waits (Serve backs off and retries), because the call it
    carries must run on that shard. A hint naming no shard of the service (n out of range, which
    only a client could send) is ignored, so no header makes a request wait forever.
    `shard:<n>:avoid:<replica>` (a replica of shard n whose engine died, passing a chat to the
    shard's other replicas) also leaves out that replica.
  * anything else is a user id, sent by the client in the `x-session-id` header (Serve's
    session header, RAY_SERVE_SESSION_ID_HEADER_KEY): the replica of that user's shard when
    the user is placed by the stable hash, else any replica, which forwards it (one hop more).
Each replica publishes its shard through Serve's `record_replica_metadata` hook.
"""

from __future__ import annotations

from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from memory.redis_keys import stable_shard

SHARD_KEY = "shard"  # replica metadata: the shard a replica serves
SHARDS_KEY = "shards"  # replica metadata: how many shards the service has
_SHARD_HINT = "shard:"
_AVOID = ":avoid:"


def shard_hint(shard: int, avoid: str | None = None) -> str:
    """The session id that sends a call to shard `shard`'s replicas (and only there), but the
    replica whose unique id is `avoid`."""
    return f"{_SHARD_HINT}{shard}" + (f"{_AVOID}{avoid}" if avoid else "")


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


def shards_of(replicas: List[RunningReplica]) -> dict[int, list[RunningReplica]]:
    """Replicas by the shard they published (replicas that have not published yet are left out)."""
    by_shard: dict[int, list[RunningReplica]] = {}
    for replica in replicas:
        shard = replica.replica_metadata.get(SHARD_KEY)
        if isinstance(shard, int):
            by_shard.setdefault(shard, []).append(replica)
    return by_shard


class UserShardRouter(RequestRouter):
    """Routes each request to the replica holding its shard (see the module docstring).

    No FIFOMixin: Serve's default matching keeps each routing attempt to the request that
    started it, so a forwarded call can never be handed to another shard's replica."""

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # one choice per attempt: back off between them
        by_shard = shards_of(candidate_replicas)
        num_shards = max((r.replica_metadata.get(SHARDS_KEY, 0) for r in candidate_replicas), default=0)
        session_id = pending_request.metadata.session_id
        shard, strict = wanted_shard(session_id, num_shards)
        if strict and _AVOID in session_id:  # a replica whose engine died passes the call to the shard's others
            avoid = session_id.split(_AVOID, 1)[1]
            by_shard[shard] = [r for r in by_shard.get(shard, []) if r.replica_id.unique_id != avoid]
            if not by_shard[shard]:
                del by_shard[shard]
        if shard is not None and shard in by_shard:
            return [by_shard[shard]]
        if strict:
            return []  # that shard's replica is not up (yet): wait for it, never run the call elsewhere
        return [candidate_replicas]
