"""Checkpoints load tensor by tensor, within their own size: a GGUF file read in place with only
its metadata written to the cache, and a sharded safetensors checkpoint as its unsharded self."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from gguf_quantize import requantized_default_gguf
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.model.checkpoint import weights_bytes
from pagedserve.model.source import resolve_model_dir

# A child process's peak resident memory (KiB, Linux's ru_maxrss): after loading the model given
# and generating from it, or with "-" after importing the engine only.
_PEAK_AFTER_LOADING = """
import resource, sys
from pagedserve import LLM, SamplingParams
if sys.argv[1] != "-":
    llm = LLM(sys.argv[1], dtype="float32", num_kv_blocks=8)
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
MIB = 2**20
# What a loaded engine holds beyond the weights and an imported engine: the default model's
# tokenizer, the C++ kernels, transformers' model classes (which name a GGUF file's tensors) and
# the allocator's slack.
RUNTIME_ALLOWANCE = 400 * MIB
# The bound on the rest, as a multiple of the file's size. With float32 activations a bfloat16
# file's linear maps are held as bfloat16 (1x their bytes) but its embeddings as float32 for the
# lookup (2x) beside float16 panels for the tied logits (1x): 1.4x the whole file here, where
# the embeddings are a fifth of it. Loading adds the largest tensor's float32 copy beside its
# parameter (0.8x). Converting the file to float32 first, as transformers does, takes 4x.
PEAK_FACTOR = 2.5
METADATA_FILES = {
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "gguf-tensors.json",
    "pagedserve-gguf-metadata",
}


def _peak_rss(model: str, cache) -> int:
    env = {**os.environ, "PAGEDSERVE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_AFTER_LOADING, model],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(result.stdout.split()[-1]) * 1024


def test_a_gguf_file_is_read_in_place_within_its_size(tmp_path):
    path = requantized_default_gguf(
        tmp_path / "SmolLM2-135M-Instruct.BF16.gguf",
        lambda name, stored: stored if stored == "F32" else "BF16",
    )
    size = path.stat().st_size
    cache = tmp_path / "cache"
    imported = _peak_rss("-", cache)
    loaded = _peak_rss(str(path), cache)
    assert loaded <= imported + RUNTIME_ALLOWANCE + PEAK_FACTOR * size, (
        f"peak {loaded / MIB:.0f} MiB: imported {imported / MIB:.0f} MiB, file {size / MIB:.0f} MiB"
    )
    written = [file for file in cache.rglob("*") if file.is_file()]
    assert {file.name for file in written} <= METADATA_FILES
    assert sum(file.stat().st_size for file in written) < 0.02 * size  # the tokenizer, mostly


def test_a_sharded_bfloat16_checkpoint_loads_as_its_unsharded_self(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("llama")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    model.save_pretrained(whole)
    model.save_pretrained(sharded, max_shard_size="100KB")
    for target in (whole, sharded):
        for tokenizer_file in source.glob("tokenizer*"):
            shutil.copy(tokenizer_file, target)
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    # A repository's weights in other names beside its shards (Mistral's consolidated.safetensors)
    # are not read: the index names the shards.
    shutil.copy(next(sharded.glob("model-*.safetensors")), sharded / "consolidated.safetensors")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    prompts = ["The history of the Roman Empire", "def fibonacci(n):"]
    whole_out, sharded_out = (
        LLM(str(checkpoint), num_kv_blocks=16).generate(prompts, params)
        for checkpoint in (whole, sharded)
    )
    for a, b in zip(whole_out, sharded_out, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_a_gguf_file_written_by_the_load_benchmark_generates_as_transformers_reads_it(
    monkeypatch, tmp_path
):
    """`pagedserve bench load`'s files of real shapes, here at a tiny shape: F16 matrices, F32
    norms, an untied output projection."""
    from conftest import reference_greedy

    from pagedserve.bench.load import Shape, write_f16_gguf

    shape = Shape(layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2)
    # Wider weights than a trained model's: logits whose top two rarely tie under float noise.
    path = write_f16_gguf(tmp_path / "random-llama-tiny.F16.gguf", shape, spread=0.2)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    llm = LLM(str(path), dtype="float32", num_kv_blocks=16)
    assert llm.engine.runner.packed_weight_dtypes == ("float16", "float16")
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for output in llm.generate(["The history of the Roman Empire", "def fibonacci(n):"], params):
        assert output.outputs[0].token_ids == reference_greedy(model, output.prompt_token_ids, 16)


@pytest.mark.parametrize("packed_weight_dtype", ["auto", "float32"])
def test_the_weights_told_before_loading_are_the_weights_held(packed_weight_dtype):
    """weights_bytes, from the default GGUF file's metadata only, against what the loaded model
    holds: its parameters, its packed maps' panels and its embeddings' blocks."""
    llm = LLM(dtype="float32", packed_weight_dtype=packed_weight_dtype, num_kv_blocks=8)
    runner = llm.engine.runner
    model = runner.model
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(
        m.panels.numel() * m.panels.element_size()
        for m in model.modules()
        if getattr(m, "panels", None) is not None
    )
    if model.embedding_blocks is not None:
        held += model.embedding_blocks.rows.nbytes
    told = weights_bytes(resolve_model_dir(None), runner.dtype, packed_weight_dtype)
    assert abs(told - held) < 0.03 * held, (told, held)


# A start on the default GGUF file: greedy tokens, then the transformers modules it imported of
# those that a first start needs (config and model classes, AutoTokenizer).
_SECOND_START = """
import json, sys
from pagedserve import LLM, SamplingParams
llm = LLM(None, dtype="float32", num_kv_blocks=8)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
tokens = llm.generate(["Hello, how are you?"], params)[0].outputs[0].token_ids
heavy = (
    "configuration_llama",
    "modeling_llama",
    "tokenization_auto",
    "modeling_utils",
    "modeling_gguf_pytorch_utils",
)
print(json.dumps([tokens, sorted(m for m in sys.modules if m.rsplit(".", 1)[-1] in heavy)]))
"""


def test_a_later_start_reads_what_the_first_derived_from_the_gguf_metadata(monkeypatch, tmp_path):
    """transformers' names of the tensors, the orders its GGUF loader takes their rows in and the
    tokenizer's class are recorded with the metadata, so that a later start builds neither
    transformers' config class nor its model (a second or two of each start), imports no GGUF
    processor, and loads the tokenizer AutoTokenizer picks."""
    import numpy as np
    from transformers import AutoTokenizer

    from pagedserve.model.gguf_blocks import GGUFNames, _mapped, linear_parts
    from pagedserve.model.source import (
        default_gguf_path,
        gguf_tensor_types,
        gguf_tokenizer_class,
        transformers_processor,
    )

    env = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path / "cache")}
    runs = [
        subprocess.run(
            [sys.executable, "-c", _SECOND_START],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        for _ in range(2)
    ]
    (first_tokens, first_imported), (tokens, imported) = (
        json.loads(run.stdout.splitlines()[-1]) for run in runs
    )
    assert tokens == first_tokens
    assert "transformers.models.llama.modeling_llama" in first_imported
    assert "transformers.modeling_gguf_pytorch_utils" in first_imported
    assert imported == []
    monkeypatch.setenv("PAGEDSERVE_CACHE", env["PAGEDSERVE_CACHE"])
    model_dir = resolve_model_dir(None)
    recorded = gguf_tokenizer_class(model_dir).from_pretrained(model_dir)
    auto = AutoTokenizer.from_pretrained(model_dir)
    assert type(recorded) is type(auto)
    chat = [{"role": "user", "content": "Hello <|im_end|> wörld"}]
    assert recorded.apply_chat_template(chat, add_generation_prompt=True) == (
        auto.apply_chat_template(chat, add_generation_prompt=True)
    )
    assert recorded.all_special_ids == auto.all_special_ids
    # Llama's queries and keys are the tensors transformers' loader reorders; the recorded orders
    # take the rows as its processor does.
    types = gguf_tensor_types(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert set(types.row_orders) == {
        f"blk.{layer}.attn_{proj}.weight"
        for layer in range(config["num_hidden_layers"])
        for proj in "qk"
    }
    names, processor = GGUFNames(types, config), transformers_processor(types.architecture, config)
    assert names.processor is None
    parts = linear_parts(default_gguf_path(), types, names)
    for name in ("blk.0.attn_q.weight", "blk.3.attn_k.weight", "blk.0.attn_v.weight"):
        rows = _mapped(default_gguf_path(), types.tensors[name])
        expected = processor.process(weights=rows, name=name, parsed_parameters={}).weights
        assert np.array_equal(parts[types.transformers_names[name]].rows, expected)


def _metadata_gguf(path, architecture: str, name: str = "tiny", tied: bool = True):
    """A GGUF file of architecture holding the metadata llama.cpp writes for a tiny model of it,
    a byte-level vocabulary with two control tokens, and its embeddings (output.weight beside
    them unless tied)."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name(name)
    writer.add_context_length(2048)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_embedding_length(64)
    writer.add_rope_freq_base(10000.0)
    writer.add_head_count(4)
    # A per-layer list of one value, as transformers reads it: that value.
    writer.add_head_count_kv([2] if architecture == "qwen2" else 2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_key_length(16)
    writer.add_value_length(16)
    writer.add_rope_dimension_count(16)
    if architecture.startswith("gemma"):
        writer.add_sliding_window(512)
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    if architecture.endswith("moe"):
        writer.add_expert_count(4)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(32)
    tokens = [*bytes_to_unicode().values(), "Ġt", "<|im_start|>", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    )
    embeddings = np.zeros((len(tokens), 64), dtype=np.float32)
    writer.add_tensor("token_embd.weight", embeddings)
    if not tied:
        writer.add_tensor("output.weight", embeddings)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _typed(settings: dict) -> dict:
    """Each setting with its type: 1, 1.0 and True differ."""
    return {key: (type(value), value) for key, value in settings.items()}


@pytest.mark.parametrize(
    "architecture, name, tied",
    [
        ("llama", "tiny", True),
        ("llama", "mistral", False),  # transformers reads a llama file named so as Mistral
        ("qwen2", "tiny", False),
        ("qwen3", "tiny", True),
        ("phi3", "tiny", False),
        ("gemma2", "tiny", True),
        ("gemma3", "tiny", True),
        ("qwen2moe", "tiny qwen2moe", False),
        ("qwen3moe", "tiny", False),
    ],
)
def test_a_gguf_files_config_and_tokenizer_are_those_transformers_builds(
    architecture, name, tied, tmp_path
):
    """The config is built from metadata read without the vocabulary's strings, and the tokenizer
    without AutoTokenizer's second reading of them: both as transformers builds them from the
    file."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pagedserve.model.gguf_config import gguf_config_dict
    from pagedserve.model.source import gguf_tokenizer

    path = _metadata_gguf(tmp_path / f"{architecture}.gguf", architecture, name, tied)
    settings = gguf_config_dict(path)
    reference = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    assert _typed(settings) == _typed(reference)
    ours = gguf_tokenizer(path, AutoConfig.for_model(**settings))
    auto = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert type(ours) is type(auto)
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    text = "<|im_start|>at the tent<|im_end|>"
    assert ours(text).input_ids == auto(text).input_ids
    assert ours.all_special_ids == auto.all_special_ids


@pytest.mark.parametrize("architecture", ["rwkv6", "falcon", "qwen35"])
def test_a_gguf_file_of_an_architecture_pagedserve_does_not_run_is_named(architecture, tmp_path):
    """Named before any metadata is written: one transformers cannot read (rwkv6), one whose
    config it builds with steps of its own (falcon), one it reads with its fast reader (qwen35)."""
    from pagedserve.model.gguf_config import gguf_config_dict

    path = _metadata_gguf(tmp_path / f"{architecture}.gguf", architecture)
    with pytest.raises(ValueError, match=rf"unsupported GGUF architecture '{architecture}'.*llama"):
        gguf_config_dict(path)
