"""The memory interface is declared once (memory.interface.MemoryInterface): MemoryShard implements
every operation with the declared parameters, and ShardClient, the replica's way into the shard's
process, offers exactly those operations (async), with the same parameter names, and no other."""

from __future__ import annotations

import inspect

import pytest

from actors.shard_client import ShardClient
from memory.interface import OPERATIONS, MemoryInterface
from memory.shard import MemoryShard

PROBE = {"health"}  # the actor's probe (actors.shard_calls), not a memory operation
CLIENT_PLUMBING = {"in_process"}  # how a client is made, not an operation


def parameters(function: object) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values() if p.name != "self"]  # type: ignore[arg-type]


def test_the_interface_declares_the_add_in_two_operations_and_one_search_size() -> None:
    assert {"prepare_add", "commit_add", "search", "update", "plan_chat"} <= set(OPERATIONS)
    assert not {"add_facts", "add_turns", "check_room", "next_turn_order", "check_encode_backlog"} & set(OPERATIONS)
    assert [name for name, _ in parameters(MemoryInterface.search)] == ["user_id", "query", "top_k"]


@pytest.mark.parametrize("operation", OPERATIONS)
def test_the_shard_implements_each_operation_as_declared(operation: str) -> None:
    assert parameters(getattr(MemoryShard, operation)) == parameters(getattr(MemoryInterface, operation))


@pytest.mark.parametrize("operation", OPERATIONS)
def test_the_client_offers_each_operation_as_declared(operation: str) -> None:
    method = getattr(ShardClient, operation)
    assert inspect.iscoroutinefunction(method), f"ShardClient.{operation} is not async"
    assert parameters(method) == parameters(getattr(MemoryInterface, operation))


def test_the_client_offers_no_operation_the_interface_does_not_declare() -> None:
    offered = {name for name, value in vars(ShardClient).items() if callable(value) and not name.startswith("_")}
    assert offered - CLIENT_PLUMBING - PROBE == set(OPERATIONS)
