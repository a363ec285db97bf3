"""TokenLimits (serve_app.replica.limits) refuses an output ask no prompt can fit beside.

The fuzz run with config.yaml's limits (no max_output_tokens) once sent max_completion_tokens far
above the 4,096-token context: planning then asked the shard for a negative prompt budget and the
chat answered 500. Real tokenizer (SmolLM2), real settings model.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from memory.prompting import PromptLayout
from serve_app.protocol import RequestRejected
from serve_app.replica.limits import TokenLimits
from serve_app.settings import ServiceSettings


@pytest.fixture(scope="module")
def limits(smollm2_dir) -> TokenLimits:
    settings = ServiceSettings(engine={"model": str(smollm2_dir), "max_model_len": 4096}, default_max_tokens=256)
    assert settings.max_output_tokens is None  # as in config.yaml: only the context bounds an answer
    return TokenLimits(PromptLayout(AutoTokenizer.from_pretrained(smollm2_dir)), settings)


@pytest.mark.parametrize("asked", [4096, 12_000])
def test_an_ask_that_fills_the_context_is_a_400_before_planning(limits: TokenLimits, asked: int) -> None:
    with pytest.raises(RequestRejected) as refused:
        limits.planned_output(asked, "max_completion_tokens")
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "max_completion_tokens"
    assert "4096" in str(refused.value)


def test_an_ask_that_leaves_room_is_planned_as_asked(limits: TokenLimits) -> None:
    assert limits.planned_output(4095, "max_tokens") == 4095
    assert limits.planned_output(None, "max_tokens") == 256
