"""Mem0's v2 filter dialect: a filter tree parsed, checked, evaluated on memories, and the users it can reach.

The grammar of Mem0's "Memory Filters" page (docs/platform/features/v2-memory-filters.mdx of
mem0ai/mem0), as the `mem0ai` client sends it in `filters` to get_all and search:
- a node is an object; its keys are ANDed. `AND` and `OR` take a non-empty list of nodes, `NOT` a
  node (or a list, read as their AND);
- entity fields `user_id`, `agent_id`, `app_id`, `run_id`: a bare value (equality), `"*"` (any
  non-null value), or one of `eq`, `ne`, `in`;
- time fields `created_at`, `updated_at`, `timestamp`, `expiration_date`: a bare value (equality)
  or `gt`, `gte`, `lt`, `lte`, `ne`, `in` (several in one object are ANDed; an explicit `eq` is
  refused, as Mem0 refuses it), ISO 8601 dates or times (a date is its midnight UTC);
- `metadata`: `{key: value}` (equality of a top-level key) or `{key: {"eq" | "ne" | "contains": v}}`;
- `categories`: `in` (a list) or `contains`; `keywords`: `contains` (case-sensitive) or `icontains`
  on the memory's text; `memory_ids`: a list of ids (or `{"in": [...]}`).
A field a memory does not have is null: `ne` matches it, every other comparison does not. This
service keeps memories per user only, so `agent_id`, `app_id`, `run_id`, `categories`, `timestamp`
and `expiration_date` are null on every memory (`{"run_id": "*"}` matches none, `{"agent_id":
{"ne": "x"}}` every one). Anything else (an unknown field or operator, `text`, `keywords_search`)
is a FilterError naming its place in the tree (`filters.AND.1.created_at`), answered 400.

`reach` is the set of users a tree can match (None: any user); the routes answer 403 for a tree
that names a user the key may not act for, and read only the key's users for an unbounded one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Union

ENTITY_FIELDS = ("user_id", "agent_id", "app_id", "run_id")
TIME_FIELDS = ("created_at", "updated_at", "timestamp", "expiration_date")
LOGICAL = ("AND", "OR", "NOT")
MAX_CONDITIONS = 200
MAX_LIST = 1000


class FilterError(ValueError):
    """A filter this service cannot read: `param` is where in the request (`filters.AND.0.user_id`)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.param = where


@dataclass(frozen=True)
class Cond:
    field: str
    op: str  # eq ne in any gt gte lt lte contains icontains
    value: Any
    key: str | None = None  # the metadata key


@dataclass(frozen=True)
class Logic:
    op: str  # AND OR NOT
    children: tuple["Node", ...]


Node = Union[Cond, Logic]
Memory = dict[str, Any]  # id, memory, user_id, metadata, created_at, updated_at (ISO 8601)


def _time(value: Any, where: str) -> float:
    if not isinstance(value, str):
        raise FilterError(where, "a time is an ISO 8601 string")
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise FilterError(where, f"not an ISO 8601 date or time: {value!r}") from exc
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


def _text_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or len(value) > MAX_LIST or not all(isinstance(v, str) for v in value):
        raise FilterError(where, f"a non-empty list of at most {MAX_LIST} strings")
    return tuple(value)


def _one_op(value: dict[str, Any], allowed: tuple[str, ...], where: str) -> tuple[str, Any]:
    if len(value) != 1 or next(iter(value)) not in allowed:
        raise FilterError(where, f"one operator of {list(allowed)}, got {list(value)}")
    return next(iter(value.items()))


class _Parser:
    def __init__(self) -> None:
        self.conditions = 0

    def cond(self, field: str, operator: str, value: Any, key: str | None = None) -> Cond:
        self.conditions += 1
        if self.conditions > MAX_CONDITIONS:
            raise FilterError("filters", f"more than {MAX_CONDITIONS} conditions")
        return Cond(field, operator, value, key)

    def node(self, value: Any, where: str) -> Node:
        if not isinstance(value, dict) or not value:
            raise FilterError(where, "a filter is a non-empty object")
        parts = [self.part(key, item, f"{where}.{key}") for key, item in value.items()]
        return parts[0] if len(parts) == 1 else Logic("AND", tuple(parts))

    def part(self, key: str, value: Any, where: str) -> Node:
        if key in ("AND", "OR"):
            if not isinstance(value, list) or not value:
                raise FilterError(where, f"{key} takes a non-empty list of filters")
            return Logic(key, tuple(self.node(item, f"{where}.{i}") for i, item in enumerate(value)))
        if key == "NOT":
            inner = self.node(value, where) if isinstance(value, dict) else self.part("AND", value, where)
            return Logic("NOT", (inner,))
        if key in ENTITY_FIELDS:
            return self.entity(key, value, where)
        if key in TIME_FIELDS:
            return self.moment(key, value, where)
        if key == "metadata":
            return self.metadata(value, where)
        if key == "categories":
            if not isinstance(value, dict):
                raise FilterError(where, "categories take {'in': [...]} or {'contains': '...'}")
            op, operand = _one_op(value, ("in", "contains"), where)
            return self.cond(key, op, _text_list(operand, f"{where}.in") if op == "in" else str(operand))
        if key == "keywords":
            op, operand = _one_op(value if isinstance(value, dict) else {}, ("contains", "icontains"), where)
            if not isinstance(operand, str):
                raise FilterError(f"{where}.{op}", "a string")
            return self.cond(key, op, operand)
        if key == "memory_ids":
            ids = value.get("in") if isinstance(value, dict) and list(value) == ["in"] else value
            return self.cond(key, "in", _text_list(ids, where))
        allowed = [*LOGICAL, *ENTITY_FIELDS, *TIME_FIELDS, "metadata", "categories", "keywords", "memory_ids"]
        raise FilterError(where, f"not a filter this service reads; a key is one of {allowed}")

    def entity(self, field: str, value: Any, where: str) -> Cond:
        if isinstance(value, str):
            return self.cond(field, "any" if value == "*" else "eq", value)
        if not isinstance(value, dict):
            raise FilterError(where, "a string, '*', or one of eq, ne, in")
        op, operand = _one_op(value, ("eq", "ne", "in"), where)
        if op == "in":
            return self.cond(field, "in", _text_list(operand, f"{where}.in"))
        if not isinstance(operand, str):
            raise FilterError(f"{where}.{op}", "a string")
        return self.cond(field, op, operand)

    def moment(self, field: str, value: Any, where: str) -> Node:
        if not isinstance(value, dict):
            return self.cond(field, "eq", _time(value, where))
        if not value:
            raise FilterError(where, "no operator")
        parts: list[Node] = []
        for op, operand in value.items():
            if op not in ("gt", "gte", "lt", "lte", "ne", "in"):
                raise FilterError(f"{where}.{op}", "operators are gt, gte, lt, lte, ne, in (equality: the bare value)")
            if op == "in":
                parts.append(self.cond(field, "in", tuple(_time(v, f"{where}.in") for v in _text_list(operand, f"{where}.in"))))
            else:
                parts.append(self.cond(field, op, _time(operand, f"{where}.{op}")))
        return parts[0] if len(parts) == 1 else Logic("AND", tuple(parts))

    def metadata(self, value: Any, where: str) -> Node:
        if not isinstance(value, dict) or not value:
            raise FilterError(where, "metadata takes {key: value} or {key: {eq | ne | contains: value}}")
        parts: list[Node] = []
        for key, operand in value.items():
            if isinstance(operand, dict):
                op, operand = _one_op(operand, ("eq", "ne", "contains"), f"{where}.{key}")
                parts.append(self.cond("metadata", op, operand, key))
            else:
                parts.append(self.cond("metadata", "eq", operand, key))
        return parts[0] if len(parts) == 1 else Logic("AND", tuple(parts))


def parse_filters(filters: Any) -> Node:
    """The tree of a request's `filters` (FilterError naming the place of anything unreadable)."""
    return _Parser().node(filters, "filters")


def reach(node: Node) -> frozenset[str] | None:
    """The users whose memories `node` can match; None: any user's."""
    if isinstance(node, Cond):
        if node.field != "user_id" or node.op in ("any", "ne"):
            return None
        return frozenset(node.value) if node.op == "in" else frozenset([node.value])
    if node.op == "NOT":
        return None
    reaches = [reach(child) for child in node.children]
    if node.op == "OR":
        return None if any(r is None for r in reaches) else frozenset().union(*reaches)  # type: ignore[arg-type]
    bounded = [r for r in reaches if r is not None]
    return frozenset.intersection(*bounded) if bounded else None


def _field(memory: Memory, cond: Cond) -> Any:
    if cond.field in ("created_at", "updated_at"):
        return datetime.fromisoformat(memory[cond.field]).timestamp()
    if cond.field == "metadata":
        return (memory.get("metadata") or {}).get(cond.key)
    return memory.get(cond.field)  # user_id; agent_id, run_id, ...: None here


_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "eq": lambda have, want: have == want, "gt": lambda have, want: have > want, "gte": lambda have, want: have >= want,
    "lt": lambda have, want: have < want, "lte": lambda have, want: have <= want, "in": lambda have, want: have in want,
    "any": lambda have, want: True,
}


def matches(node: Node, memory: Memory) -> bool:
    """Whether `memory` (a MemoryItem's fields) is selected by `node` (module docstring's semantics)."""
    if isinstance(node, Logic):
        if node.op == "NOT":
            return not matches(node.children[0], memory)
        results = (matches(child, memory) for child in node.children)
        return all(results) if node.op == "AND" else any(results)
    if node.field == "memory_ids":
        return memory["id"] in node.value
    if node.field == "keywords":
        text = memory["memory"]
        return node.value in text if node.op == "contains" else node.value.lower() in text.lower()
    have = _field(memory, node)
    if node.op == "ne":
        return have != node.value
    if have is None:
        return False
    if node.op == "contains":
        if isinstance(have, str) and isinstance(node.value, str):
            return node.value.lower() in have.lower() if node.field == "categories" else node.value in have
        return isinstance(have, list) and node.value in have
    return _COMPARE[node.op](have, node.value)
