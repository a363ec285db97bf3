"""The OpenAI API's pieces beyond chat that run without an engine: the Responses request as a chat, its
server-sent events from a chat's chunks, the stored responses in a real Redis (per key, capped, erased
with their user), the embeddings request's refusals, and how many copies of one generation answer `n`.
The same pieces on the live service: tests/test_openai_client.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from memory.response_store import ResponseStore
from serve_app.embeddings_protocol import EmbeddingRequest
from serve_app.ingress.response_events import ResponseEvents, response_events
from serve_app.protocol import ChatCompletionChunk, ChunkChoice, ChunkDelta, Usage
from serve_app.replica.sampling import choice_copies
from serve_app.responses_protocol import ResponseObject, ResponsesRequest


def test_n_greedy_choices_are_copies_of_one_generation_and_sampled_ones_are_not() -> None:
    assert choice_copies(None, 3) == 3 and choice_copies(0.0, 2) == 2  # greedy: one generation given n times
    assert choice_copies(1.0, 3) == 1 and choice_copies(None, None) == 1 and choice_copies(0.7, 1) == 1


def test_a_responses_request_is_a_chat_with_instructions_history_and_input() -> None:
    request = ResponsesRequest.model_validate({
        "input": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        "instructions": "You are kind.", "max_output_tokens": 7, "user": "erin", "metadata": {"a": "b"}, "store": False,
    })
    chat = request.as_chat([{"role": "user", "content": "Earlier"}, {"role": "assistant", "content": "Said"}])
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "You are kind."), ("user", "Earlier"), ("assistant", "Said"), ("system", "Be brief."), ("user", "Hi")]
    assert (chat.max_completion_tokens, chat.user, request.stored) == (7, "erin", False)
    for refused in ({"input": "x", "tools": []}, {"input": "x", "reasoning": {}}, {"input": [{"type": "function_call", "role": "user", "content": "x"}]},
                    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}):
        with pytest.raises(ValidationError):
            ResponsesRequest.model_validate(refused)


def _chunk(text: str | None, finish: str | None = None, usage: Usage | None = None) -> str:
    chunk = ChatCompletionChunk(id="c", model="m", choices=[ChunkChoice(delta=ChunkDelta(content=text), finish_reason=finish)], usage=usage)
    return f"data: {chunk.model_dump_json()}\n\n"


def test_a_chat_stream_becomes_the_responses_events_in_openai_order() -> None:
    started = ResponseObject.started("resp_" + "0" * 32, ResponsesRequest(input="Hi"), "m")
    usage = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    chat_events = [_chunk("Hel"), _chunk("lo", "stop", usage), "data: [DONE]\n\n"]
    kept: list[ResponseObject] = []

    async def keep(final: ResponseObject) -> ResponseObject:
        kept.append(final)
        return final

    async def run(events: list[str]) -> list[dict]:
        async def source():
            for event in events:
                yield event

        return [json.loads(e.split("data: ", 1)[1]) async for e in response_events(ResponseEvents(started), source(), keep)]

    sent = asyncio.run(run(chat_events))
    assert [e["type"] for e in sent] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    final = sent[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["usage"]["output_tokens"] == 2 and kept[0].status == "completed"
    broken = asyncio.run(run(chat_events[:1]))  # the replica's stream stopped before its last chunk
    assert broken[-1]["type"] == "error" and len(kept) == 1  # nothing stored for it


def test_stored_responses_are_per_key_capped_and_erased_with_their_user(redis_server) -> None:
    async def run() -> None:
        store = ResponseStore.from_url(redis_server.url, "resp-test", ttl_s=60, max_per_key=2)
        said = [{"role": "user", "content": "Hi"}]
        await store.put("resp_a", "key1", "erin", said, {"id": "resp_a"})
        assert (await store.get("resp_a", "key1"))["conversation"] == said
        assert await store.get("resp_a", "key2") is None  # another key's: not found
        assert await store.delete("resp_a", "key2") is False and await store.get("resp_a", "key1") is not None
        await store.put("resp_b", "key1", None, said, {})
        await store.put("resp_c", "key1", "erin", said, {})  # past max_per_key: the key's oldest goes
        assert await store.get("resp_a", "key1") is None and await store.get("resp_b", "key1") is not None
        assert await store.forget_user("erin") == 2 and await store.get("resp_c", "key1") is None
        assert await store.get("resp_b", "key1") is not None  # not the user's
        assert await store.delete("resp_b", "key1") is True and await store.get("resp_b", "key1") is None
        await store.close()

    asyncio.run(run())


def test_embedding_requests_take_text_and_refuse_token_ids_by_name() -> None:
    assert EmbeddingRequest.model_validate({"input": ["a", "b"], "encoding_format": "base64"}).texts == ["a", "b"]
    assert EmbeddingRequest.model_validate({"input": "a"}).texts == ["a"]
    for refused in ({"input": [1, 2]}, {"input": [[1, 2]]}, {"input": []}, {"input": ""}, {"input": "a", "encoding_format": "int8"}, {"input": "a", "extra": 1}):
        with pytest.raises(ValidationError):
            EmbeddingRequest.model_validate(refused)
    with pytest.raises(ValidationError, match="token ids"):
        EmbeddingRequest.model_validate({"input": [[1, 2]]})


def test_a_text_completion_of_token_ids_reaches_vllms_model_as_its_prompt() -> None:
    from serve_app.completion_protocol import CompletionRequest
    from serve_app.replica.sampling import completion_sampling_params

    for prompt in ([1, 2, 3], [[1, 2, 3]]):  # an empty text prompt once made vLLM's own model refuse it (a 500)
        request = CompletionRequest.model_validate({"prompt": prompt, "max_tokens": 4, "n": 2})
        assert request.token_ids == [1, 2, 3] and request.text == ""
        params = completion_sampling_params(request, 4)
        assert (params.max_tokens, params.n) == (4, 1)  # greedy n: one generation, given twice
    with pytest.raises(ValidationError, match="one prompt per request"):
        CompletionRequest.model_validate({"prompt": ["a", "b"]})
