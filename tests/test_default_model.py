"""The embedded SmolLM2 model: same greedy tokens as transformers reading the same GGUF file."""

from __future__ import annotations

import pytest
import torch
from conftest import reference_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve import LLM, SamplingParams
from pagedserve.model.source import default_gguf_path

PROMPTS = (
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "Here is a short list of European capitals:",
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def gguf_reference():
    path = default_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return tokenizer, model


def test_greedy_matches_transformers_on_the_gguf(llm, gguf_reference):
    tokenizer, model = gguf_reference
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(list(PROMPTS), params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        assert output.prompt_token_ids == prompt_ids
        assert output.outputs[0].token_ids == reference_greedy(model, prompt_ids, 32)
        assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids)


def test_chat_knows_the_capital_of_france(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(question, SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"
