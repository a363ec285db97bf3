"""Mem0's v2 filter trees by themselves (serve_app.memory_filters): what each selects on memories in
MemoryItem's shape, the users a tree reaches (the routes' 403), and a refusal naming the place of
anything unreadable. Through the service and the `mem0ai` client: tests/test_mem0_filters.py."""

from __future__ import annotations

from typing import Any

import pytest

from serve_app.memory_filters import FilterError, matches, parse_filters, reach

MEMORIES = [
    {"id": "a", "memory": "Pays the Invoice by email", "user_id": "u1", "metadata": {"source": "email", "tags": ["x"]},
     "created_at": "2024-01-05T00:00:00+00:00", "updated_at": "2024-03-01T00:00:00+00:00"},
    {"id": "b", "memory": "Walks the dog", "user_id": "u1", "metadata": None,
     "created_at": "2024-02-05T00:00:00+00:00", "updated_at": "2024-02-05T00:00:00+00:00"},
    {"id": "c", "memory": "Reads email", "user_id": "u2", "metadata": {"source": "email"},
     "created_at": "2025-01-01T12:00:00+00:00", "updated_at": "2025-01-01T12:00:00+00:00"},
]


def _selected(filters: dict[str, Any]) -> set[str]:
    node = parse_filters(filters)
    return {m["id"] for m in MEMORIES if matches(node, m)}


@pytest.mark.parametrize("filters, selected, reached", [
    ({"user_id": "u1"}, {"a", "b"}, {"u1"}),
    ({"AND": [{"user_id": "u1"}, {"metadata": {"source": "email"}}]}, {"a"}, {"u1"}),
    ({"OR": [{"user_id": "u2"}, {"run_id": "r"}]}, {"c"}, None),
    ({"OR": [{"user_id": "u2"}, {"user_id": "u1"}]}, {"a", "b", "c"}, {"u1", "u2"}),
    ({"user_id": {"in": ["u2", "u9"]}}, {"c"}, {"u2", "u9"}),
    ({"user_id": "*"}, {"a", "b", "c"}, None),
    ({"user_id": {"ne": "u1"}}, {"c"}, None),
    ({"AND": [{"created_at": {"gte": "2024-01-01"}}, {"created_at": {"lt": "2024-02-01T00:00:00Z"}}]}, {"a"}, None),
    ({"updated_at": {"gt": "2024-02-05T00:00:00Z"}}, {"a", "c"}, None),
    ({"NOT": {"metadata": {"source": "email"}}}, {"b"}, None),
    ({"metadata": {"source": {"ne": "email"}}}, {"b"}, None),
    ({"metadata": {"tags": {"contains": "x"}}}, {"a"}, None),
    ({"keywords": {"contains": "Invoice"}}, {"a"}, None),
    ({"keywords": {"contains": "invoice"}}, set(), None),
    ({"keywords": {"icontains": "invoice"}}, {"a"}, None),
    ({"memory_ids": ["a", "c"]}, {"a", "c"}, None),
    ({"AND": [{"user_id": "u1"}, {"agent_id": "*"}]}, set(), {"u1"}),
    ({"agent_id": {"ne": "x"}}, {"a", "b", "c"}, None),
    ({"AND": [{"user_id": "u1"}, {"categories": {"in": ["finance"]}}]}, set(), {"u1"}),
    ({"user_id": "u1", "metadata": {"source": "email"}}, {"a"}, {"u1"}),  # sibling keys ANDed
    ({"AND": [{"user_id": "u1"}, {"OR": [{"user_id": "u2"}, {"memory_ids": ["b"]}]}]}, {"b"}, {"u1"}),
])
def test_a_tree_selects_and_reaches(filters: dict[str, Any], selected: set[str], reached: set[str] | None) -> None:
    assert _selected(filters) == selected
    assert reach(parse_filters(filters)) == (None if reached is None else frozenset(reached))


@pytest.mark.parametrize("filters, where", [
    ({"user_id": "u1", "bogus_key": "z"}, "filters.bogus_key"),
    ({"AND": [{"user_id": "u1"}, {"created_at": {"eq": "2024-01-01"}}]}, "filters.AND.1.created_at.eq"),
    ({"AND": [{"metadata": {"type": {"in": ["a"]}}}]}, "filters.AND.0.metadata.type"),
    ({"AND": []}, "filters.AND"),
    ({"created_at": {"gte": "yesterday"}}, "filters.created_at.gte"),
    ({"user_id": {"eq": 3}}, "filters.user_id.eq"),
    ({"categories": {"eq": "finance"}}, "filters.categories"),
    ({}, "filters"),
])
def test_an_unreadable_tree_is_refused_naming_its_place(filters: dict[str, Any], where: str) -> None:
    with pytest.raises(FilterError) as refused:
        parse_filters(filters)
    assert refused.value.param == where
