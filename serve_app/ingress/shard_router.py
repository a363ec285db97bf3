"""UserShardRouter: Ray Serve's request router, sending a request to the replica of its shard.

Used by the `routing: direct` topology (serve_app.direct_ingress), where each LLM replica is
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

from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from serve_app.shard_routing import SHARD_KEY, SHARDS_KEY, avoided_replica, wanted_shard

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
        avoid = avoided_replica(session_id)  # a chat passed on from a replica whose engine is down
        if strict and avoid is not None:
            by_shard[shard] = [r for r in by_shard.get(shard, []) if r.replica_id.unique_id != avoid]
            if not by_shard[shard]:
                del by_shard[shard]
        if shard is not None and shard in by_shard:
            return [by_shard[shard]]
        if strict:
            return []  # that shard's replica is not up (yet): wait for it, never run the call elsewhere
        return [candidate_replicas]
