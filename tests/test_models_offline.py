"""The offline models load in vLLM and agree with transformers (greedy, fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


def transformers_greedy(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Plain argmax decoding, EOS included (what vLLM does with ignore_eos=True)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    past = None
    with torch.no_grad():
        for _ in range(max_tokens):
            step = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            next_id = int(step.logits[0, -1].argmax())
            out.append(next_id)
            ids = torch.tensor([[next_id]])
    return out


def vllm_greedy(llm, prompt_ids: list[int], max_tokens: int) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    (result,) = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False)
    return list(result.outputs[0].token_ids)


def test_converted_smollm2_is_a_plain_checkpoint(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert "quantization_config" not in config


def test_smollm2_greedy_matches_transformers(smollm2_dir: Path, engine_factory) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = transformers_greedy(smollm2_dir, prompt_ids, 16)
    llm = engine_factory.offline(smollm2_dir)
    got = vllm_greedy(llm, prompt_ids, 16)
    assert got == expected, (tokenizer.decode(got), tokenizer.decode(expected))
    assert "Paris" in tokenizer.decode(got)


def test_rotary_family_loads_in_vllm_and_generates(rotary_family: str, tiny_models, engine_factory) -> None:
    model_dir = tiny_models(rotary_family)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tokenizer("Caroline adopted a dog named Rex in the summer.")["input_ids"]
    expected = transformers_greedy(model_dir, prompt_ids, 12)
    llm = engine_factory.offline(model_dir)
    got = vllm_greedy(llm, prompt_ids, 12)
    assert len(got) == 12
    assert got == expected
