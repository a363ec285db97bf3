"""A reconciled add crosses into its shard twice, whatever it holds (issue 35): prepare_add, then
commit_add (memory.add_plan), with N extracted facts for N = 1, 3, 8 (it took 6 + N + K calls).

Every call the replica's add makes goes through the typed ShardClient, whose transport is counted
here: each `actor.<method>.remote(...)` the client makes is one round trip into the shard's process
(over Ray in the service; here over the in-process actor handle ShardClient.in_process uses, the
same client code). The shard is a real MemoryShard (real Redis, real embedder, real index). The
engine is scripted, because the test needs exactly N extracted facts: it answers each extraction
prompt with the user's message as the one fact (grounded: memory.grounding keeps it) and each
reconcile prompt with an UPDATE of the closest fact, so the add both updates and adds.
The same path on the real engine through the served API: tests/test_reconcile_serve.py.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
from transformers import AutoTokenizer

from actors.shard_client import ShardClient
from memory.prompting import PromptLayout
from memory.records import NewFact
from memory.shard import MemoryShard
from serve_app.memory_protocol import AddMemoryRequest, MemoryMessage, add_answer
from serve_app.replica.adding import MemoryAdds
from serve_app.replica.limits import TokenLimits
from serve_app.settings import ServiceSettings
from tests.test_memory_shard import shard_settings


class CountingActor:
    """An actor handle that records every round trip (`method.remote(...)`) before making it."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        counting = self

        class Method:
            def options(self, **options: Any) -> "Method":
                return self

            def remote(self, *args: Any, **kwargs: Any) -> Any:
                counting.calls.append(name)
                return getattr(counting.actor, name).remote(*args, **kwargs)

        return Method()


@dataclass
class Output:
    text: str


@dataclass
class RequestOutput:
    outputs: list[Output]


class ScriptedEngine:
    """AsyncLLM's generate() for extraction and reconcile prompts (module docstring)."""

    def __init__(self, tokenizer: Any, messages: list[str]) -> None:
        self.tokenizer, self.messages = tokenizer, messages
        self.requests: list[str] = []

    async def generate(self, prompt: Any, params: Any, request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        text = self.tokenizer.decode(prompt["prompt_token_ids"])
        self.requests.append(request_id.split("-")[0])
        if request_id.startswith("extract-"):
            said = [m for m in self.messages if f"user: {m}" in text]
            answer = json.dumps({"facts": said[:1]})
        else:
            answer = json.dumps({"event": "UPDATE", "id": 0, "text": ""})
        yield RequestOutput([Output(answer)])


@pytest.fixture(scope="module")
def shard(smollm2_dir: Path, redis_server) -> Any:
    settings = shard_settings(window_turns=0).model_copy(update={"reconcile_top_k": 3, "reconcile_min_score": 0.2})
    shard = MemoryShard(0, settings, str(smollm2_dir), "float32", redis_server.url, namespace=uuid.uuid4().hex[:8])
    yield shard
    shard.arena.close()
    shutil.rmtree(settings.arena_dir, ignore_errors=True)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_a_reconciled_add_makes_two_shard_round_trips_whatever_it_extracts(shard: MemoryShard, smollm2_dir: Path, n: int) -> None:
    user = f"ivy-{n}"
    shard.add_facts(user, [NewFact(text="Ivy lives in Leeds with her cat."), NewFact(text="Ivy works as a nurse in Leeds.")])
    messages = [f"Ivy moved to the town number {i} in Norway." for i in range(n)]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    engine = ScriptedEngine(tokenizer, messages)
    transport = CountingActor(ShardClient.in_process(shard).actor)
    client = ShardClient(transport, timeout_s=300)
    service = ServiceSettings(engine={"model": str(smollm2_dir), "max_model_len": 2048}, memory=shard.settings)
    adds = MemoryAdds(lambda: engine, PromptLayout(tokenizer), client, TokenLimits(PromptLayout(tokenizer), service), shard.settings, lambda u: u)
    request = AddMemoryRequest(user_id=user, messages=[MemoryMessage(role="user", content=m) for m in messages], reconcile=True)

    result = asyncio.run(adds.add(request))

    assert transport.calls == ["prepare_add", "commit_add"]
    assert engine.requests.count("extract") == n and engine.requests.count("reconcile") == n  # every fact had candidates
    assert result.extraction is not None and result.extraction.facts_grounded == n
    events = [o.event for o in result.outcomes]
    assert events.count("UPDATE") == 1 and events.count("ADD") == n - 1  # one change per existing fact, the rest added
    updated = next(o for o in result.outcomes if o.event == "UPDATE")
    assert updated.previous_text is not None and updated.previous_text.startswith("Ivy ") and updated.text in messages
    assert {r.text for r in shard.get_all(user)} == set(messages) | {"Ivy lives in Leeds with her cat.", "Ivy works as a nurse in Leeds."} - {updated.previous_text}
    for item in add_answer(result)["results"]:  # Mem0's shape, made at the edge
        keys = {"id", "memory", "event"} | ({"previous_memory"} if item["event"] == "UPDATE" else set())
        assert set(item) == keys


def test_an_add_of_given_facts_and_turns_makes_the_same_two_round_trips(shard: MemoryShard, smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    transport = CountingActor(ShardClient.in_process(shard).actor)
    service = ServiceSettings(engine={"model": str(smollm2_dir), "max_model_len": 2048}, memory=shard.settings)
    adds = MemoryAdds(lambda: None, PromptLayout(tokenizer), ShardClient(transport, timeout_s=300),
                      TokenLimits(PromptLayout(tokenizer), service), shard.settings, lambda u: u)  # no engine: nothing to extract
    turns = [{"turn_id": f"D1:{i}", "speaker": "Una", "text": f"I said thing {i}."} for i in range(3)]
    request = AddMemoryRequest.model_validate({"user_id": "una", "turns": turns, "facts": ["Una sails.", "Una sings."], "source_id": "D1:2"})
    result = asyncio.run(adds.add(request))
    assert transport.calls == ["prepare_add", "commit_add"]
    assert [o.event for o in result.outcomes] == ["ADD", "ADD"] and result.extraction is None
    assert [t.turn_id for t in shard.store.window_before("una", "D1:2", 5)] == ["D1:0", "D1:1"]  # placed in the add's order
