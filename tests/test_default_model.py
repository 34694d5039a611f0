"""The embedded SmolLM2 model: same greedy tokens as transformers reading the same GGUF file."""

from __future__ import annotations

import pytest
import torch
from conftest import reference_greedy
from gguf_quantize import requantized_default_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve import LLM, SamplingParams
from pagedserve.model.quantization import quantize_q4_1, quantize_q8_0
from pagedserve.model.source import (
    GGUFTensorTypes,
    default_gguf_path,
    gguf_tensor_types,
    resolve_model_dir,
)

PROMPTS = (
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "Here is a short list of European capitals:",
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32")  # packed_weight_dtype auto: q4_1, the GGUF file's own


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


def test_q4_1_holds_the_gguf_weights_exactly(gguf_reference):
    """The GGUF stores every linear map as Q4_1 and the (tied) embeddings as Q8_0. Quantized
    again, the weights transformers dequantized from it come back to the same bits when
    dequantized as gguf does (scale * value + minimum, in float32), so --packed-weight-dtype
    q4_1, with its q8_0 logits, holds the model as published."""
    _, model = gguf_reference
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            weight = module.weight.detach()
            values, scales, minima = quantize_q4_1(weight)
            groups = values.float().view(*scales.shape, 32)
            held = groups * scales.float()[..., None] + minima.float()[..., None]
            assert torch.equal(held.view(weight.shape), weight), name
    embeddings = model.get_input_embeddings().weight.detach()
    values, scales = quantize_q8_0(embeddings)
    held = values.float().view(*scales.shape, 32) * scales.float()[..., None]
    assert torch.equal(held.view(embeddings.shape), embeddings)


def test_auto_packs_a_q4_1_gguf_as_q4_1_and_other_checkpoints_as_float32(llm, tiny_checkpoint):
    assert llm.engine.runner.packed_weight_dtypes == ("q4_1", "q8_0")  # token_embd is Q8_0
    # The lookup reads the same Q8_0 blocks: no float table beside them.
    model = llm.engine.runner.model
    assert model.embed_tokens is None and model.embedding_blocks.type == "Q8_0"
    other = LLM(str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=8)
    assert other.engine.runner.packed_weight_dtypes == ("float32", "float32")


@pytest.mark.parametrize(
    ("map_type", "embedding_type", "packed_as"),
    [
        ("Q8_0", "Q8_0", ("q8_0", "q8_0")),
        # Neither bfloat16 nor Q8_0 holds float16 embeddings exactly; float16 panels do.
        ("BF16", "F16", ("bfloat16", "float16")),
    ],
)
def test_auto_packs_a_gguf_as_its_own_types_with_greedy_equal_to_transformers(
    map_type, embedding_type, packed_as, monkeypatch, tmp_path
):
    stored_as = {"Q4_1": map_type, "Q8_0": embedding_type}  # the maps', the embeddings'
    path = requantized_default_gguf(
        tmp_path / f"SmolLM2-135M-Instruct.{map_type}.gguf",
        lambda name, stored: stored_as.get(stored, stored),
    )
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))  # its metadata, gone after
    llm = LLM(str(path), dtype="float32")
    assert gguf_tensor_types(resolve_model_dir(str(path))) == GGUFTensorTypes(
        frozenset({map_type}), embedding_type, "llama"
    )
    assert llm.engine.runner.packed_weight_dtypes == packed_as
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for output in llm.generate(list(PROMPTS), params):
        assert output.outputs[0].token_ids == reference_greedy(model, output.prompt_token_ids, 32)


def test_float32_packed_greedy_matches_transformers_on_the_gguf(gguf_reference):
    _, model = gguf_reference
    llm = LLM(dtype="float32", packed_weight_dtype="float32")
    assert llm.engine.runner.model.embedding_blocks is None  # the tied logits need the table
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for output in llm.generate(list(PROMPTS), params):
        assert output.outputs[0].token_ids == reference_greedy(model, output.prompt_token_ids, 32)


def test_the_transformers_baseline_reads_the_gguf_file_itself(llm):
    """The benchmarks' baseline runs on the file the engine reads in place: the cache holds no
    weights for transformers to load."""
    from pagedserve.bench.datasets import BenchRequest
    from pagedserve.bench.hf_baseline import run_transformers
    from pagedserve.bench.offline import EngineSetup

    setup = EngineSetup.of(llm.engine)
    assert setup.gguf_path == default_gguf_path()
    run = run_transformers([BenchRequest([1, 2, 3, 4], 4)], 1, setup)
    assert run.output_tokens == 4 and len(run.e2e_s) == 1


def test_chat_knows_the_capital_of_france(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(question, SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"
