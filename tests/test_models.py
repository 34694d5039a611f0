"""The models people bring (issue 30): RoPE variants from the config, Phi-3, Gemma 2 and 3, and
the mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE, token-exact against transformers' own
generate on each prompt alone, in float32; hub names from a local cache; a chat template of one's
own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ON_CPU, ROPE_VARIANTS, greedy_references
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedserve import LLM, SamplingParams
from pagedserve.model.config import ModelConfig
from pagedserve.model.rotary import RotaryEmbedding, default_frequencies
from pagedserve.server.serve import served_model_name

# Below, at and beyond the variants' original context of 64 positions; the shorter ones pass it
# while generating.
PROMPT_LENGTHS = (1, 9, 40, 63, 64, 100, 180, 300)
NEW_TOKENS = 32


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, 49152, n).tolist() for n in PROMPT_LENGTHS]


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def references(tiny_checkpoint):
    return greedy_references(tiny_checkpoint, _prompts(), NEW_TOKENS)


@pytest.mark.parametrize("variant", ROPE_VARIANTS)
def test_rope_variants_match_transformers(variant, tiny_checkpoint, references):
    llm = LLM(str(tiny_checkpoint(variant)), dtype="float32")
    assert llm.engine.runner.model_config.rope_type == variant.rsplit("-")[-1]
    assert _generate(llm) == references(variant)


def test_phi3_matches_transformers(tiny_checkpoint, references):
    """Phi-3: its checkpoint's fused qkv_proj and gate_up_proj, longrope, a sliding window."""
    llm = LLM(str(tiny_checkpoint("phi3")), dtype="float32")
    config = llm.engine.runner.model_config
    assert (config.architecture, config.rope_type, config.sliding_window) == (
        "Phi3ForCausalLM",
        "longrope",
        48,
    )
    assert _generate(llm) == references("phi3")


def test_phi4_mini_rotates_part_of_each_head_as_transformers_does(tiny_checkpoint, references):
    """Phi-4-mini: partial_rotary_factor 0.75 (RoPE over 12 of 16 dimensions) with longrope."""
    llm = LLM(str(tiny_checkpoint("phi4-mini")), dtype="float32")
    assert llm.engine.runner.model_config.rotary_dim == 12
    assert _generate(llm) == references("phi4-mini")


def test_gemma2_matches_transformers(tiny_checkpoint, references):
    """Gemma 2: sandwich norms with (1 + w) weights, GeGLU, scaled embeddings, capped attention
    scores and logits, sliding layers alternating with global ones; on the C++ kernels (packed
    weights, norms) where they compute the same, the attention in torch."""
    llm = LLM(str(tiny_checkpoint("gemma2")), dtype="float32")
    runner = llm.engine.runner
    config = runner.model_config
    assert config.layer_types == ("sliding_attention", "full_attention")
    assert (runner.packed_weight_dtypes is not None) == ON_CPU and not runner.decode_in_place
    assert _generate(llm) == references("gemma2")
    # Capping the logits leaves the greedy token alone: the log-probabilities show it.
    prompt = _prompts()[2]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    token = out.outputs[0].token_ids[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("gemma2"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    expected = torch.log_softmax(logits, dim=-1)[token].item()
    assert out.outputs[0].logprobs[0][token].logprob == pytest.approx(expected, abs=1e-4)


def test_gemma3_matches_transformers(tiny_checkpoint, references):
    """Gemma 3 (text): q and k norms with (1 + w) weights, RoPE per layer type, sliding layers
    beside global ones; its attention read in place by the C++ kernel, each layer with its own
    window and rotation."""
    llm = LLM(str(tiny_checkpoint("gemma3")), dtype="float32")
    runner = llm.engine.runner
    assert runner.model_config.rope_type == "linear" and runner.decode_in_place == ON_CPU
    assert sorted(runner.model.rotary) == ["full_attention", "sliding_attention"]
    assert _generate(llm) == references("gemma3")


@pytest.mark.parametrize("architecture", ["mixtral", "qwen3-moe", "qwen2-moe"])
def test_mixtures_of_experts_match_transformers(architecture, tiny_checkpoint, references):
    """Mixtral (its w1/w2/w3 experts), Qwen3-MoE (q and k norms, a dense layer among the sparse
    ones) and Qwen2-MoE (a gated shared expert): top-2 of 4 experts, each expert's maps packed
    for the C++ kernels."""
    llm = LLM(str(tiny_checkpoint(architecture)), dtype="float32")
    runner = llm.engine.runner
    assert runner.model_config.num_experts == 4
    assert (runner.packed_weight_dtypes is not None) == ON_CPU
    experts = runner.model.layers[0].mlp.experts
    assert all(expert.gate_up_proj.method.name == "float32" for expert in experts) == ON_CPU
    shared = runner.model.layers[0].mlp.shared_expert
    assert (shared is not None) == (architecture == "qwen2-moe")
    assert _generate(llm) == references(architecture)


@pytest.mark.parametrize(
    "variant", ["llama-longrope", "llama3", "phi3", "gemma2", "gemma3", "mixtral"]
)
def test_rope_variants_match_transformers_chunked_and_preempted(
    variant, tiny_checkpoint, references
):
    """longrope's angles depend on the prompt's length: chunks of a long prompt, and a request
    recomputed after preemption, still take the long factors."""
    llm = LLM(
        str(tiny_checkpoint(variant)),
        dtype="float32",
        block_size=8,
        num_kv_blocks=60,
        max_num_batched_tokens=64,
    )
    assert _generate(llm) == references(variant)
    assert llm.engine.scheduler.num_preemptions > 0


def test_torch_operators_take_the_same_rope(tiny_checkpoint, references):
    llm = LLM(str(tiny_checkpoint("qwen2-yarn")), dtype="float32", cpu_kernels=False)
    assert _generate(llm) == references("qwen2-yarn")


def test_a_config_without_model_type_takes_its_architectures():
    raw = LlamaConfig(hidden_size=64, num_attention_heads=4).to_dict()
    raw["architectures"] = ["LlamaForCausalLM"]
    raw["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    del raw["model_type"]
    linear = RotaryEmbedding.from_config(ModelConfig.from_dict(raw), torch.float32)
    default = RotaryEmbedding(default_frequencies(16, 10000.0), 8, torch.float32)
    # Linear scaling by 2 halves the frequencies: position 6 turns as far as position 3 did.
    assert torch.equal(linear(torch.tensor([6])).cos, default(torch.tensor([3])).cos)


def test_an_unknown_rope_type_is_refused_by_name():
    raw = LlamaConfig(hidden_size=64, num_attention_heads=4).to_dict()
    raw["architectures"] = ["LlamaForCausalLM"]
    raw["rope_scaling"] = {"rope_type": "mrope", "factor": 2.0}
    raw.pop("rope_parameters", None)
    with pytest.raises(ValueError, match="unsupported rope_type 'mrope'; pagedserve supports"):
        ModelConfig.from_dict(raw)
    raw["rope_scaling"] = None
    raw["partial_rotary_factor"] = 0.0625  # one of a head's 16 dimensions: no pair to rotate
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.0625: it must rotate an even"):
        ModelConfig.from_dict(raw)


# Hub names, resolved through a Hugging Face cache laid out here, offline.

_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _run_offline(hf_home, model: str) -> subprocess.CompletedProcess:
    """Greedy tokens of one prompt from LLM(model) in a fresh process with HF_HOME=hf_home and
    HF_HUB_OFFLINE=1, printed as JSON."""
    script = (
        "import json, sys; from pagedserve import LLM, SamplingParams; "
        "llm = LLM(sys.argv[1], dtype='float32'); "
        "out = llm.generate([{'prompt_token_ids': [5, 6, 7, 8]}], "
        "SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)); "
        "print(json.dumps(out[0].outputs[0].token_ids))"
    )
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-c", script, model], env=env, capture_output=True, text=True, timeout=300
    )


def test_a_hub_name_loads_from_the_local_cache_offline(tiny_checkpoint, tmp_path):
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama3"
    shutil.copytree(tiny_checkpoint("llama3"), repo / "snapshots" / _COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(_COMMIT)
    here = LLM(str(repo / "snapshots" / _COMMIT), dtype="float32")
    expected = (
        here.generate(
            [{"prompt_token_ids": [5, 6, 7, 8]}],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        )[0]
        .outputs[0]
        .token_ids
    )
    for name in ("tiny-org/tiny-llama3", f"tiny-org/tiny-llama3@{_COMMIT}"):
        run = _run_offline(tmp_path, name)
        assert run.returncode == 0, run.stderr[-2000:]
        assert json.loads(run.stdout.strip().splitlines()[-1]) == expected
    missing = _run_offline(tmp_path, "tiny-org/not-cached")
    assert missing.returncode != 0
    assert "model 'tiny-org/not-cached' is not in the Hugging Face cache" in missing.stderr


def test_served_model_name_of_a_hub_name_is_the_repository():
    assert served_model_name("Qwen/Qwen2.5-0.5B-Instruct@main") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert served_model_name("/models/SmolLM2.Q4_1.gguf") == "SmolLM2.Q4_1"


def test_a_chat_template_file_replaces_the_tokenizers(tiny_checkpoint, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    )
    llm = LLM(str(tiny_checkpoint("llama3")), dtype="float32", chat_template=str(template))
    ids = llm.chat_token_ids([{"role": "user", "content": "hi"}])
    assert llm.get_tokenizer().decode(ids) == "[user] hi\n[assistant] "
    with pytest.raises(ValueError, match=r"chat_template 'no-such\.jinja' is neither a file"):
        LLM(str(tiny_checkpoint("llama3")), dtype="float32", chat_template="no-such.jinja")
