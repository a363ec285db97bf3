"""Composition of a memory-conditioned prompt and its connector parameters.

A served prompt is [instruction prefix][memory_1 ... memory_k][query]: every memory segment
sits contiguously after the previous one, the query right after the last. The same token ids
serve both paths: prompt injection (send them, no parameters) and KV injection (send them
with the parameters returned here, so the connector supplies the memory tokens' KV).

Every prompt carries a prefix-cache salt: per user (user_namespace), per API key for a request
that names no user (key_namespace); the two kinds of namespace are disjoint by construction.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvarena.arena import EntryRef
from kvarena.params import EntryPlacement, KVMemoryParams


@dataclass(frozen=True)
class StoredSegment:
    """An arena entry and the token ids it holds the KV of."""

    ref: EntryRef
    token_ids: tuple[int, ...]


@dataclass
class ComposedPrompt:
    prompt_token_ids: list[int]
    params: KVMemoryParams
    cache_salt: str
    memory_end: int  # prompt position right after the last memory token
    placements: list[EntryPlacement] = field(default_factory=list)

    def kv_transfer_params(self) -> dict[str, Any]:
        return self.params.to_kv_transfer_params()


def user_namespace(prefix: str, user_id: str) -> str:
    """The salt namespace of user `user_id`'s requests in the deployment whose Redis prefix is
    `prefix`. Kind, prefix and name are JSON-encoded as one list, so no user id (however it is
    spelt: `key:key_X`, `a:b`, with quotes or `|`) names another user's or a key's namespace."""
    return json.dumps(["user", prefix, user_id])


def key_namespace(prefix: str, key_id: str) -> str:
    """The salt namespace of an API key's requests that name no user (see user_namespace)."""
    return json.dumps(["key", prefix, key_id])


def scope_cache_salt(namespace: str) -> str:
    """Prefix-cache salt of a request that injects nothing (prompt or no memory, encodes):
    prefilled blocks are shared only among requests of the same scope (a user, or a key), so a
    prefix-cache hit, or the `cached_tokens` it reports, never reveals another user's text.
    `namespace`: user_namespace or key_namespace."""
    return f"kvmem-s-{hashlib.sha256(namespace.encode()).hexdigest()[:32]}"


def user_salt(prefix: str, user_id: str) -> str:
    """The prefix-cache salt of user `user_id`'s requests that inject nothing."""
    return scope_cache_salt(user_namespace(prefix, user_id))


def key_salt(prefix: str, key_id: str) -> str:
    """The prefix-cache salt of key `key_id`'s requests that name no user (never a user's salt)."""
    return scope_cache_salt(key_namespace(prefix, key_id))


def memory_cache_salt(namespace: str, segments: Sequence[StoredSegment]) -> str:
    """Prefix-cache salt naming exactly which stored KV a prompt's blocks hold.

    Injected KV differs from a prefill of the same token ids (each fact was encoded without
    the others), so injected blocks may only be reused by requests injecting the same entries
    (same ids, same generations) for the same namespace (user_namespace). Namespace and entries
    are hashed as one JSON document, so no namespace can pass for another plus some entries.
    """
    entries = [[segment.ref.entry_id, segment.ref.generation] for segment in segments]
    digest = hashlib.sha256(json.dumps([namespace, entries]).encode())
    return f"kvmem-{digest.hexdigest()[:32]}"


def compose(
    segments: Sequence[StoredSegment], query_token_ids: Sequence[int], namespace: str, start: int = 0
) -> ComposedPrompt:
    """Lay segments out contiguously from `start`, then the query."""
    if not query_token_ids:
        raise ValueError("the query must hold at least one token (vLLM computes at least one)")
    prompt: list[int] = []
    placements: list[EntryPlacement] = []
    position = start
    for segment in segments:
        placements.append(EntryPlacement(entry=segment.ref.entry_id, generation=segment.ref.generation, start=position))
        prompt.extend(segment.token_ids)
        position += len(segment.token_ids)
    prompt.extend(query_token_ids)
    return ComposedPrompt(
        prompt_token_ids=prompt,
        params=KVMemoryParams(inject=placements),
        cache_salt=memory_cache_salt(namespace, segments),
        memory_end=position,
        placements=placements,
    )
