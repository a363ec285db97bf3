"""A chat's (or text completion's) sampling parameters through vLLM's own OpenAI protocol models, and logprobs
in OpenAI's shape. Runs in the LLM replica (imports vLLM).

vLLM's ChatCompletionRequest already validates OpenAI's sampling fields and turns them into
SamplingParams (Ray Serve LLM reuses it too), so the replica hands it the fields this service
implements (serve_app.protocol bounds them first) instead of re-implementing their semantics:
stop, seed, temperature, top_p, penalties, logprobs / top_logprobs, n, and response_format (a JSON
object or schema, as vLLM's structured outputs). The temperature is the request's, else the service's
greedy default, whatever n is; n greedy choices are one generation given n times (`choice_copies`). The use is kept small because
the GPU machines run another vLLM (0.25.1) than the CPU ones (0.32): the class is looked up in
either module layout, and `to_sampling_params` is called with the arguments its signature names.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Iterator

from pydantic import ValidationError

from serve_app.completion_protocol import CompletionRequest
from serve_app.protocol import ChatCompletionRequest, ChoiceLogprobs, EngineUnavailable, RequestRejected, TokenLogprob, TopLogprob

# The fields vLLM turns into sampling parameters; max_tokens is decided by the replica.
_SAMPLING_FIELDS = {
    "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
    "logprobs", "top_logprobs", "stream", "stream_options", "n", "response_format",
}
SERVICE_TEMPERATURE = 0.0  # the service's default is greedy (OpenAI's is 1), whatever n is
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily


def choice_copies(temperature: float | None, n: int | None) -> int:
    """How many copies of one generation answer a request: n when it samples greedily (its temperature,
    or the service's default 0, below GREEDY_BELOW), else 1. The n greedy answers are one answer (OpenAI
    gives n identical choices at temperature 0), and vLLM refuses n > 1 with greedy sampling, so the
    engine runs it once with n = 1 and the answer is given n times (serve_app.replica.chat_responses.Choices)."""
    greedy = (SERVICE_TEMPERATURE if temperature is None else temperature) < GREEDY_BELOW
    return (n or 1) if greedy else 1


def vllm_client_errors() -> tuple[type[BaseException], ...]:
    """vLLM's exceptions for a request it refuses (a 4xx): ValueError, and VLLMClientError where
    this vLLM has it (it does not derive from ValueError)."""
    try:
        from vllm.exceptions import VLLMClientError  # vLLM: not in `serve run`'s driver
    except ImportError:  # an older vLLM: its validation errors are ValueErrors
        return (ValueError,)
    return (ValueError, VLLMClientError)


@contextmanager
def refusals_as_rejections() -> Iterator[None]:
    """vLLM's refusal of a request (bad sampling or structured-output arguments) as RequestRejected (400)."""
    try:
        yield
    except RequestRejected:  # our own refusal (a ValueError too): its param and code stay
        raise
    except vllm_client_errors() as exc:
        raise RequestRejected(str(exc), param=getattr(exc, "parameter", None)) from None


@contextmanager
def engine_errors_as_ours(replica_id: str) -> Iterator[None]:
    """No vLLM exception leaves the replica: the ingress would import vLLM (and torch) to unpickle
    it, which held the CPU ingress's event loop for 11 s when an engine core was killed. A refusal
    becomes RequestRejected (400), a dead engine EngineUnavailable naming this replica (503; a chat
    goes on to the shard's other replicas)."""
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError  # vLLM: not in `serve run`'s driver

    try:
        with refusals_as_rejections():
            yield
    except (EngineDeadError, EngineGenerateError) as exc:
        raise EngineUnavailable(f"the engine of this replica is down ({type(exc).__name__}: {exc})", replica_id) from None


@lru_cache(maxsize=1)
def vllm_chat_request_class() -> type:
    # vLLM: not in `serve run`'s driver
    try:  # vLLM 0.3x: one protocol module per route family
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest
    except ImportError:  # vLLM 0.2x: one protocol module for the whole OpenAI server
        from vllm.entrypoints.openai.protocol import ChatCompletionRequest as VllmRequest  # type: ignore[no-redef]
    return VllmRequest


@lru_cache(maxsize=1)
def vllm_completion_request_class() -> type:
    # vLLM: not in `serve run`'s driver
    try:  # vLLM 0.3x
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmRequest
    except ImportError:  # vLLM 0.2x
        from vllm.entrypoints.openai.protocol import CompletionRequest as VllmRequest  # type: ignore[no-redef]
    return VllmRequest


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    error = exc.errors()[0]
    cause = (error.get("ctx") or {}).get("error")
    param = getattr(cause, "parameter", None) or ".".join(str(p) for p in error.get("loc", ())) or None
    return str(error.get("msg", exc)).removeprefix("Value error, "), param


def sampling_params(request: ChatCompletionRequest, max_tokens: int, extra_args: dict[str, Any] | None = None) -> Any:
    """vLLM SamplingParams for `request` with `max_tokens`, cumulative outputs (the replica slices
    the streamed text itself) and `extra_args` (the plan's kv_transfer_params). RequestRejected
    when vLLM refuses the combination."""
    body = request.model_dump(include=_SAMPLING_FIELDS, exclude_none=True, by_alias=True)  # response_format's `schema`
    body["messages"] = request.prompt_messages()
    return _through_vllm(vllm_chat_request_class(), body, max_tokens, extra_args)


def completion_sampling_params(request: CompletionRequest, max_tokens: int) -> Any:
    """vLLM SamplingParams for a text completion (serve_app.completion_protocol), as for a chat."""
    body = request.model_dump(include=_SAMPLING_FIELDS, exclude_none=True)
    body["prompt"] = request.token_ids or request.text  # vLLM's model refuses an empty prompt; ids are a prompt to it too
    return _through_vllm(vllm_completion_request_class(), body, max_tokens, None)


def _through_vllm(vllm_request: type, body: dict[str, Any], max_tokens: int, extra_args: dict[str, Any] | None) -> Any:
    from vllm.sampling_params import RequestOutputKind  # vLLM: not in `serve run`'s driver

    body.setdefault("temperature", SERVICE_TEMPERATURE)
    if choice_copies(body["temperature"], body.get("n")) > 1:
        body["n"] = 1  # one greedy generation, given n times (choice_copies)
    try:
        parsed = vllm_request.model_validate(body)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise RequestRejected(message, param=param) from None
    arguments = inspect.signature(parsed.to_sampling_params).parameters
    kwargs: dict[str, Any] = {"default_sampling_params": {}}
    if "logits_processor_pattern" in arguments:  # vLLM <= 0.2x
        kwargs["logits_processor_pattern"] = None
    with refusals_as_rejections():  # SamplingParams' own checks
        params = parsed.to_sampling_params(max_tokens, **kwargs)
    params.output_kind = RequestOutputKind.CUMULATIVE
    if extra_args:
        params.extra_args = {**(params.extra_args or {}), **extra_args}
    return params


def _token_text(token_id: int, decoded: str | None, tokenizer: Any) -> str:
    return decoded if decoded is not None else tokenizer.decode([token_id])


def choice_logprobs(completion: Any, start: int, top: int, tokenizer: Any) -> ChoiceLogprobs | None:
    """OpenAI's logprobs for the completion's tokens from position `start` on (None when the
    request asked for none): the chosen token and its `top` most likely alternatives each."""
    if completion.logprobs is None:
        return None
    content = []
    for position in range(start, len(completion.token_ids)):
        token_id = completion.token_ids[position]
        candidates = completion.logprobs[position] or {}
        chosen = candidates.get(token_id)
        if chosen is None:  # vLLM always reports the sampled token; be safe if it did not
            continue
        text = _token_text(token_id, chosen.decoded_token, tokenizer)
        ranked = sorted(candidates.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
        alternatives = [
            TopLogprob(token=(t := _token_text(i, lp.decoded_token, tokenizer)), logprob=max(lp.logprob, -9999.0), bytes=list(t.encode()))
            for i, lp in ranked
            if lp.rank is not None and lp.rank <= top
        ][:top]
        content.append(
            TokenLogprob(token=text, logprob=max(chosen.logprob, -9999.0), bytes=list(text.encode()), top_logprobs=alternatives)
        )
    return ChoiceLogprobs(content=content)
