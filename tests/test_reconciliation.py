"""Reconciling extracted facts with the memory (serve_app.replica.reconciliation), without the engine.

The decision's schema, prompt, aliasing and validation are plain functions: tested on answers a
model could give (malformed, unknown alias, another user's fact). The decisions are applied
by a real MemoryShard's commit_add (real Redis, real embedder) behind the typed ShardClient, so
history events and ownership checks are the shard's own.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from actors.shard_client import ShardClient
from memory.add_plan import AddBatch, AddCommit
from memory.records import NewFact
from memory.index.settings import IndexSettings
from memory.records import MemoryHit
from memory.settings import ArenaCapacity, MemorySettings
from memory.shard import MemoryShard
from serve_app.replica.reconciliation import (
    Candidate,
    Decision,
    alias_candidates,
    decide as decide_all,
    decision_messages,
    decision_schema,
    one_decision_per_target,
    parse_decision,
)

LEEDS = Candidate(0, "fact-leeds-uuid", "I live in Leeds.", 0.39)
CAT = Candidate(1, "fact-cat-uuid", "I have a cat called Miso.", 0.09)
BERLIN = NewFact(text="I live in Berlin now.", source_id="m-1")


def decide(raw: str, min_score: float = 0.3) -> Decision:
    return parse_decision(raw, BERLIN, [LEEDS, CAT], min_score=min_score)


def test_aliases_are_small_integers_and_the_prompt_never_shows_a_fact_id() -> None:
    hits = [MemoryHit("f-a", "A.", 0.9), MemoryHit("f-b", "B.", 0.5), MemoryHit("f-a", "A.", 0.9)]
    candidates = alias_candidates(hits)
    assert [(c.alias, c.fact_id) for c in candidates] == [(0, "f-a"), (1, "f-b")]
    messages = decision_messages("New.", [LEEDS, CAT])
    assert messages[-1] == {"role": "user", "content": "Memory:\n0: I live in Leeds.\n1: I have a cat called Miso.\n\nNew fact: New."}
    assert not any("uuid" in m["content"] for m in messages)
    assert [m["role"] for m in messages[:3]] == ["system", "user", "assistant"]  # worked examples before the fact
    assert json.loads(messages[2]["content"])["event"] in {"ADD", "UPDATE", "DELETE", "NONE"}


def test_schema_bounds_events_and_aliases() -> None:
    schema = decision_schema(3)
    assert schema["properties"]["event"]["enum"] == ["ADD", "UPDATE", "DELETE", "NONE"]
    assert (schema["properties"]["id"]["minimum"], schema["properties"]["id"]["maximum"]) == (-1, 2)
    assert set(schema["required"]) == {"event", "id", "text"} and schema["additionalProperties"] is False


def test_valid_decisions_map_aliases_back_to_fact_ids() -> None:
    update = decide('{"event": "UPDATE", "id": 0, "text": "I now live in Berlin."}')
    assert (update.event, update.target, update.text) == ("UPDATE", LEEDS, "I now live in Berlin.")
    delete = decide('{"event": "DELETE", "id": 0, "text": ""}')
    assert (delete.event, delete.target.fact_id) == ("DELETE", "fact-leeds-uuid")
    assert decide('{"event": "ADD", "id": -1, "text": ""}').event == "ADD"
    assert decide('{"event": "NONE", "id": 0, "text": ""}').target == LEEDS


@pytest.mark.parametrize(
    "raw",
    [
        "",  # nothing generated
        '{"event": "UPDATE", "id": 0, "text": "I live',  # truncated
        "not json at all",
        "[0]",  # not an object
        '{"event": "REPLACE", "id": 0}',  # no such event
        '{"event": "UPDATE", "id": 7, "text": "x"}',  # alias never shown
        '{"event": "DELETE", "id": "0"}',  # alias must be the integer shown
        '{"event": "DELETE", "id": true}',
        '{"event": "DELETE", "id": -1}',
        '{"event": "UPDATE", "id": 1, "text": "I live in Berlin."}',  # the cat fact: below the similarity floor
        '{"event": "NONE", "id": 1, "text": ""}',
    ],
)
def test_invalid_or_unrelated_decisions_fall_back_to_add(raw: str) -> None:
    decision = decide(raw)
    assert (decision.event, decision.target) == ("ADD", None) and decision.note


def test_update_text_must_be_grounded_in_the_new_fact() -> None:
    # the old text, nothing, an example's text, words of neither fact, too long to fit one entry
    for proposed in ("I live in Leeds.", "", "Anna now works as a lawyer.", "I live in Berlin with my sister.", "I live in Berlin " * 3):
        decision = parse_decision(
            json.dumps({"event": "UPDATE", "id": 0, "text": proposed}), BERLIN, [LEEDS], fits=lambda t: len(t) < 40
        )
        assert (decision.event, decision.text) == ("UPDATE", BERLIN.text)


def test_a_fact_already_in_memory_is_none_whatever_the_model_says() -> None:
    same = NewFact(text="i live in leeds")
    decision = parse_decision('{"event": "UPDATE", "id": 1, "text": "x"}', same, [LEEDS, CAT])
    assert (decision.event, decision.target) == ("NONE", LEEDS)


def test_one_change_per_existing_fact() -> None:
    first = decide('{"event": "UPDATE", "id": 0, "text": ""}')
    second = parse_decision('{"event": "DELETE", "id": 0, "text": ""}', NewFact(text="I moved to Berlin."), [LEEDS])
    none = decide('{"event": "NONE", "id": 0, "text": ""}')
    out = one_decision_per_target([first, second, none])
    assert [d.event for d in out] == ["UPDATE", "ADD", "NONE"] and out[1].fact.text == "I moved to Berlin."
    closer = Candidate(0, LEEDS.fact_id, LEEDS.text, 0.8)  # the same fact, more similar to this new fact
    third = parse_decision('{"event": "UPDATE", "id": 0, "text": ""}', NewFact(text="I live in Berlin."), [closer])
    assert [d.event for d in one_decision_per_target([first, third])] == ["ADD", "UPDATE"]


def test_a_fact_with_no_related_memory_is_added_without_asking_the_model() -> None:
    candidates = [[MemoryHit("f-cat", "I have a cat called Miso.", 0.09)]]
    engine = None  # never reached: nothing is related enough to be shown
    out = asyncio.run(decide_all(engine, None, [BERLIN], candidates, min_score=0.3, fits=lambda t: True))
    assert [(d.event, d.target, d.note) for d in out] == [("ADD", None, "no related memory")]


@pytest.fixture()
def shard(smollm2_dir: Path, redis_server):
    settings = MemorySettings(
        window_turns=0,
        redis_prefix=f"t{uuid.uuid4().hex[:8]}",
        arena_dir=tempfile.mkdtemp(prefix="kvmem-reconcile-", dir="/dev/shm" if Path("/dev/shm").exists() else None),
        arena=ArenaCapacity(num_pages=256, max_entries=64),
        index=IndexSettings(backend="exact", device="cpu"),
    )
    shard = MemoryShard(0, settings, str(smollm2_dir), "float32", redis_server.url, namespace=uuid.uuid4().hex[:8])
    yield shard
    shard.arena.close()
    shutil.rmtree(settings.arena_dir, ignore_errors=True)


def test_decisions_land_in_history_and_never_touch_another_users_fact(shard: MemoryShard) -> None:
    client = ShardClient.in_process(shard)
    leeds, cat = (r.fact_id for r in shard.add_facts("ivy", [NewFact(text="I live in Leeds."), NewFact(text="I have a cat.")]))
    (foreign,) = (r.fact_id for r in shard.add_facts("olaf", [NewFact(text="I live in Oslo.")]))
    hits = shard.search("ivy", BERLIN.text, 5)
    assert {h.fact_id for h in hits} == {leeds, cat}  # the search only ever offers ivy's facts
    by_id = {c.fact_id: c for c in alias_candidates(hits)}
    forged = Candidate(9, foreign, "I live in Oslo.", 0.99)  # a target no search of ivy's returned
    decisions = [
        Decision("UPDATE", BERLIN, by_id[leeds], "I live in Berlin now."),
        Decision("DELETE", NewFact(text="I gave my cat away."), by_id[cat]),
        Decision("UPDATE", NewFact(text="I like Oslo."), forged, "I like Oslo."),
        Decision("DELETE", NewFact(text="I never lived in Oslo."), forged),
    ]
    batch = AddBatch(user_id="ivy", extracted=[d.fact for d in decisions], reconcile=True)
    results = asyncio.run(client.commit_add(AddCommit(batch=batch, decisions=[d.message() for d in decisions]))).outcomes
    events = [(r.event, r.text) for r in results]
    assert events[:2] == [("UPDATE", "I live in Berlin now."), ("DELETE", "I have a cat.")]
    assert results[0].fact_id == leeds and results[0].previous_text == "I live in Leeds."
    assert sorted(events[2:]) == [("ADD", "I gave my cat away."), ("ADD", "I like Oslo."), ("ADD", "I never lived in Oslo.")]
    assert shard.get(foreign, "olaf").text == "I live in Oslo." and shard.get(foreign).version == 1  # untouched
    assert [e.event for e in shard.history(foreign)] == ["ADD"]
    assert [e.event for e in shard.history(leeds)] == ["ADD", "UPDATE"]
    assert [e.event for e in shard.history(cat)] == ["ADD", "DELETE"]
    assert {r.text for r in shard.get_all("ivy")} == {"I live in Berlin now.", "I gave my cat away.", "I like Oslo.", "I never lived in Oslo."}
