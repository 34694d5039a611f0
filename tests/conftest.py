"""Shared fixtures: tiny random checkpoints made with transformers, and the default model."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from pagedserve.engine.model_runner import resolve_device
from pagedserve.server.process import LocalServer

# Under pytest-xdist (`make test` runs a worker per core), each worker, and every server it
# starts, computes on one thread: two workers of two threads each would contend for the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Where the engine runs by default (device "auto"): transformers' references run there too.
TEST_DEVICE = resolve_device("auto")
ON_CPU = TEST_DEVICE.type == "cpu"
TINY_ARCHITECTURES = ("llama", "llama-tied", "mistral", "qwen2", "qwen3")
# Small enough to run in a blink, large enough that GQA, biases and norms all matter.
_TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    # Wider weights than the default 0.02 give logits whose top two rarely tie under float noise.
    initializer_range=0.2,
)
# Gemma's own settings: q.k scaled by 24 ** -0.5 rather than head_dim's, a window of 48 (shorter
# than the longer prompts) on its sliding layers.
_GEMMA_SHAPE = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=48, **_TINY_SHAPE)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pagedserve.model.source import resolve_model_dir

    return resolve_model_dir(None)


def _tiny_config(architecture: str, vocab_size: int):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    if architecture == "llama":
        return LlamaConfig(vocab_size=vocab_size, **_TINY_SHAPE)
    if architecture == "llama-tied":
        return LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=True, **_TINY_SHAPE)
    if architecture == "mistral":
        # A window shorter than the longer prompts, so the window mask is exercised.
        return MistralConfig(vocab_size=vocab_size, sliding_window=48, **_TINY_SHAPE)
    if architecture == "qwen2":
        return Qwen2Config(vocab_size=vocab_size, **_TINY_SHAPE)
    if architecture == "qwen3":
        return Qwen3Config(vocab_size=vocab_size, head_dim=24, rope_theta=1e6, **_TINY_SHAPE)
    if architecture in ROPE_VARIANTS:
        return _rope_variant_config(architecture, vocab_size)
    if architecture == "gemma2":
        # Gemma 2's shape of model: (1 + w) norms before and after attention and MLP, GeGLU,
        # scaled embeddings, capped attention scores and logits, and sliding layers (window 48,
        # shorter than the longer prompts) alternating with global ones.
        return Gemma2Config(
            vocab_size=vocab_size,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=8.0,
            **_GEMMA_SHAPE,
        )
    if architecture == "gemma3":
        # Gemma 3 (text): Gemma 2's layers without the caps, with q and k norms, and RoPE of its
        # own per layer type: local layers at base 10,000, global ones at 1,000,000 with
        # linear scaling 8, as the 4B and larger models have it.
        return Gemma3TextConfig(
            vocab_size=vocab_size,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
            **_GEMMA_SHAPE,
        )
    if architecture == "mixtral":
        # Four experts, two per token, in every layer.
        return MixtralConfig(
            vocab_size=vocab_size, num_local_experts=4, num_experts_per_tok=2, **_TINY_SHAPE
        )
    # The Qwen mixtures: top 2 of 4 experts, the second layer dense (mlp_only_layers), as a
    # config may ask.
    qwen_moe = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[1]
    )
    if architecture == "qwen3-moe":
        # Qwen3-30B-A3B's shape of config: q and k norms, renormalised top-k weights.
        return Qwen3MoeConfig(
            vocab_size=vocab_size, head_dim=16, norm_topk_prob=True, **qwen_moe, **_TINY_SHAPE
        )
    if architecture == "qwen2-moe":
        # Qwen1.5-MoE-A2.7B's: q, k and v biased, a shared expert beside the routed ones, top-k
        # weights as the softmax gives them.
        return Qwen2MoeConfig(
            vocab_size=vocab_size, shared_expert_intermediate_size=96, **qwen_moe, **_TINY_SHAPE
        )
    if architecture == "phi4-mini":
        # Phi-4-mini's: RoPE over the first 3/4 of each head only, longrope, tied embeddings.
        return Phi3Config(
            vocab_size=vocab_size,
            partial_rotary_factor=0.75,
            tie_word_embeddings=True,
            rope_scaling=_rope_variant_scaling("llama-longrope", rotated_fraction=0.75),
            pad_token_id=0,
            **_TINY_SHAPE,
        )
    if architecture == "phi3":
        # Phi-3 mini 128k's shape of config: fused projections in the checkpoint, longrope, and
        # (as the 4k model has) a sliding window, shorter than the longer prompts.
        return Phi3Config(
            vocab_size=vocab_size,
            sliding_window=48,
            rope_scaling=_rope_variant_scaling("llama-longrope"),
            pad_token_id=0,
            **_TINY_SHAPE,
        )
    raise ValueError(architecture)


# RoPE scalings of the models people serve, each over an original context of 64 positions that
# the tests' longer prompts and outputs pass: Llama 3.x (llama3, tied embeddings as in 3.2),
# Qwen2.5's yarn, Phi-3's longrope, and the older linear and dynamic.
ROPE_VARIANTS = ("llama-linear", "llama-dynamic", "llama3", "qwen2-yarn", "llama-longrope")
_ORIGINAL_CONTEXT = 64


def _rope_variant_config(variant: str, vocab_size: int):
    from transformers import LlamaConfig, Qwen2Config

    scaling = _rope_variant_scaling(variant)
    if variant == "qwen2-yarn":
        return Qwen2Config(vocab_size=vocab_size, rope_scaling=scaling, **_TINY_SHAPE)
    tied = variant == "llama3"
    return LlamaConfig(
        vocab_size=vocab_size, rope_scaling=scaling, tie_word_embeddings=tied, **_TINY_SHAPE
    )


def _rope_variant_scaling(variant: str, rotated_fraction: float = 1.0) -> dict:
    head_dim = _TINY_SHAPE["hidden_size"] // _TINY_SHAPE["num_attention_heads"]
    half_head = int(head_dim * rotated_fraction) // 2  # longrope: a factor per frequency
    original = {"original_max_position_embeddings": _ORIGINAL_CONTEXT}
    return {
        "llama-linear": {"rope_type": "linear", "factor": 4.0},
        "llama-dynamic": {"rope_type": "dynamic", "factor": 4.0},
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            **original,
        },
        "qwen2-yarn": {"rope_type": "yarn", "factor": 4.0, **original},
        "llama-longrope": {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(half_head)],
            "long_factor": [2.0 + 0.5 * i for i in range(half_head)],
            **original,
        },
    }[variant]


@pytest.fixture(scope="session")
def tokenizer_dir(request) -> Path:
    """The default model's tokenizer files: PAGEDSERVE_TEST_TOKENIZER_DIR where it is set (a GPU
    machine given the tokenizer without the model's weights), else the default model's dir."""
    given = os.environ.get("PAGEDSERVE_TEST_TOKENIZER_DIR")
    return Path(given) if given else request.getfixturevalue("default_model_dir")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tokenizer_dir):
    """Returns a function making (and caching) a random checkpoint dir for an architecture.

    The checkpoint reuses the default model's tokenizer, so text prompts work too.
    """
    from transformers import AutoModelForCausalLM

    made: dict[str, Path] = {}

    def make(architecture: str) -> Path:
        if architecture not in made:
            torch.manual_seed(0)
            config = _tiny_config(architecture, vocab_size=49152)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            target = tmp_path_factory.mktemp(f"tiny-{architecture}")
            model.save_pretrained(target)
            for name in _TOKENIZER_FILES:
                if (tokenizer_dir / name).is_file():
                    shutil.copy(tokenizer_dir / name, target / name)
            made[architecture] = target
        return made[architecture]

    return make


def rounded_to_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales): x's last dimension in groups of 32, each rounded as q4_1_q8 rounds a
    linear map's inputs, in float32 as its kernel computes: scale = largest magnitude / 127,
    value = round-half-even(x * (127 / largest magnitude)); x ~ scale * value. Values are
    [..., groups, 32], scales [..., groups, 1]."""
    groups = x.reshape(*x.shape[:-1], -1, 32)
    largest = groups.abs().amax(dim=-1, keepdim=True)
    return (groups * torch.where(largest > 0, 127 / largest, 0.0)).round(), largest / 127


def greedy_references(tiny_checkpoint, prompts: list[list[int]], max_new_tokens: int):
    """A function giving, for an architecture, transformers' greedy outputs of each prompt
    alone on its tiny checkpoint, computed once."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, list[list[int]]] = {}

    def get(architecture: str) -> list[list[int]]:
        if architecture not in cache:
            model = AutoModelForCausalLM.from_pretrained(
                tiny_checkpoint(architecture), dtype=torch.float32
            ).to(TEST_DEVICE)
            cache[architecture] = [reference_greedy(model, p, max_new_tokens) for p in prompts]
        return cache[architecture]

    return get


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate for one prompt alone, end-of-sequence ignored."""
    return _greedy_generate(model, prompt, max_new_tokens)[0, len(prompt) :].tolist()


def reference_greedy_with_margins(
    model, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """reference_greedy's tokens, and at each step the gap between the top two logits."""
    out = _greedy_generate(
        model, prompt, max_new_tokens, output_logits=True, return_dict_in_generate=True
    )
    top_two = [logits[0].topk(2).values for logits in out.logits]
    return out.sequences[0, len(prompt) :].tolist(), [float(a - b) for a, b in top_two]


def _greedy_generate(model, prompt: list[int], max_new_tokens: int, **options):
    model.generation_config.eos_token_id = None
    input_ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        return model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **options,
        )


class ServerProcess(LocalServer):
    """A real `pagedserve serve` process on 127.0.0.1, stopped on close()."""

    def __init__(self, *args: str, program: list[str] | None = None):
        super().__init__(list(args), startup_timeout=180.0, program=program)


def metric(base_url: str, name: str, labels: str = "") -> float:
    """The sum of a Prometheus metric's samples on a server's /metrics, those whose labels hold
    `labels` (e.g. 'finished_reason="length"')."""
    text = httpx.get(f"{base_url}/metrics").text
    pattern = rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, flags=re.MULTILINE))
