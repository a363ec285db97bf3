"""The kvmem request parameters: both inject forms (a list of placements, or columns), their
validation, and the connector's scheduler side planning the same injection from either (no engine)."""

from __future__ import annotations

import types

import numpy as np
import pytest
from pydantic import ValidationError

from connector.scheduler import KVMemoryScheduler
from kvarena.arena import ArenaGeometry, FactArena
from kvarena.params import EntryPlacement, KVMemoryParams

PLACEMENTS = [EntryPlacement(entry=3, generation=2, start=40), EntryPlacement(entry=0, generation=1, start=0)]


def test_the_wire_form_is_column_wise_and_reads_back_to_the_same_placements() -> None:
    wire = KVMemoryParams(inject=PLACEMENTS, capture=EntryPlacement(entry=5, generation=1, start=60)).to_kv_transfer_params()
    assert wire == {
        "kvmem": {
            "inject_columns": {"entry": [3, 0], "generation": [2, 1], "start": [40, 0]},
            "capture": {"entry": 5, "generation": 1, "start": 60},
        }
    }
    back = KVMemoryParams.from_kv_transfer_params(wire)
    assert back is not None and back.injects_anything
    for got, want in zip(back.inject_arrays(), ([3, 0], [2, 1], [40, 0])):
        assert got.dtype == np.int64 and got.tolist() == want
    assert back.capture == EntryPlacement(entry=5, generation=1, start=60)


def test_the_list_form_a_person_writes_is_still_accepted() -> None:
    body = {"kvmem": {"inject": [p.model_dump() for p in PLACEMENTS]}}
    params = KVMemoryParams.from_kv_transfer_params(body)
    assert params is not None and params.injects_anything
    assert [a.tolist() for a in params.inject_arrays()] == [[3, 0], [2, 1], [40, 0]]


@pytest.mark.parametrize(
    "body",
    [
        {"inject": [{"entry": 1, "generation": 1, "start": 0}], "inject_columns": {"entry": [1], "generation": [1], "start": [0]}},
        {"inject_columns": {"entry": [1, 2], "generation": [1], "start": [0, 5]}},
        {"inject_columns": {"entry": [1], "generation": [0], "start": [0]}},
        {"inject_columns": {"entry": [-1], "generation": [1], "start": [0]}},
        {"inject_columns": {"entry": [1], "generation": [1], "start": [0], "extra": [1]}},
        {"inject_columns": {"entry": [2**63], "generation": [1], "start": [0]}},
        {"inject_columns": {"entry": [1], "generation": [1], "start": [2**40]}},
        {"inject": [{"entry": 1, "generation": 2**64, "start": 0}]},
    ],
    ids=["both-forms", "unequal-lengths", "generation-0", "negative-entry", "unknown-field", "entry-beyond-int64",
         "start-beyond-any-context", "list-form-generation-beyond-int64"],
)
def test_malformed_columns_are_refused(body: dict) -> None:
    with pytest.raises(ValidationError):
        KVMemoryParams.from_kv_transfer_params({"kvmem": body})


def test_the_scheduler_answers_out_of_range_values_with_a_prefill_not_an_error(tmp_path) -> None:
    """A client of vLLM's own server can send any kv_transfer_params: a value numpy cannot hold
    must not reach the connector's arithmetic (an exception there would fail the engine step)."""
    arena = FactArena.create(tmp_path / "arena", ArenaGeometry(num_layers=1, num_kv_heads=1, head_size=8, dtype="float32", num_pages=4, max_entries=4))
    try:
        side = KVMemoryScheduler(arena, block_size=8)
        request = types.SimpleNamespace(
            request_id="r", kv_transfer_params={"kvmem": {"inject_columns": {"entry": [2**70], "generation": [1], "start": [0]}}},
            prompt_token_ids=[1, 2, 3], cache_salt="salt", num_prompt_tokens=3,
        )  # fmt: skip
        assert side.get_num_new_matched_tokens(request, 0) == 0
        assert side.fallbacks == 1
    finally:
        arena.close()


def test_no_inject_is_nothing_to_inject() -> None:
    assert not KVMemoryParams().injects_anything
    assert not KVMemoryParams(inject_columns={"entry": [], "generation": [], "start": []}).injects_anything
    assert KVMemoryParams().to_kv_transfer_params() == {"kvmem": {}}


def test_the_scheduler_plans_the_same_injection_from_either_form(tmp_path) -> None:
    geometry = ArenaGeometry(num_layers=2, num_kv_heads=2, head_size=32, dtype="float32", page_tokens=8, num_pages=16, max_entries=8)
    arena = FactArena.create(tmp_path / "arena", geometry)
    try:
        first, second = list(range(10, 22)), list(range(30, 39))
        refs = []
        for tokens in (first, second):
            ref = arena.allocate(tokens, encode_start=0)
            arena.commit(ref)
            refs.append(ref)
        placements = [EntryPlacement(entry=r.entry_id, generation=r.generation, start=s) for r, s in zip(refs, (0, len(first)))]
        prompt = first + second + [2, 3]
        side = KVMemoryScheduler(arena, block_size=8)
        plans = []
        for name, wire in (
            ("columns", KVMemoryParams(inject=placements).to_kv_transfer_params()),
            ("list", {"kvmem": {"inject": [p.model_dump() for p in placements]}}),
        ):
            request = types.SimpleNamespace(
                request_id=name, kv_transfer_params=wire, prompt_token_ids=prompt, cache_salt="salt", num_prompt_tokens=len(prompt)
            )
            assert side.get_num_new_matched_tokens(request, 0) == len(first) + len(second)
            plans.append(side.plans[name])
            assert side.request_finished(request) is not None
        for field in ("inject_positions", "inject_slots", "inject_distances"):
            np.testing.assert_array_equal(getattr(plans[0], field), getattr(plans[1], field))
        assert side.fallbacks == 0 and int(arena.entries["pins"].sum()) == 0
    finally:
        arena.close()
