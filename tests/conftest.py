"""Shared fixtures: tiny random checkpoints made with transformers, and the default model."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from pagedserve.server.process import LocalServer

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
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pagedserve.model.source import resolve_model_dir

    return resolve_model_dir(None)


def _tiny_config(architecture: str, vocab_size: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

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
    raise ValueError(architecture)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, default_model_dir):
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
                if (default_model_dir / name).is_file():
                    shutil.copy(default_model_dir / name, target / name)
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
    input_ids = torch.tensor([prompt])
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
