"""Benchmark workloads as token ids, so that every server counts the prompt tokens we meant.

Output lengths are exact because every request is sent with ignore_eos.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATASETS = ("random", "shared-prefix", "w1")
W1_NUM_REQUESTS = 64


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def engine_prompt(self) -> dict[str, list[int]]:
        """The prompt as LLM.generate and LLMEngine.add_request take token ids."""
        return {"prompt_token_ids": self.prompt_token_ids}


def w1_requests() -> list[BenchRequest]:
    """The fixed workload W1: 64 requests, 4,429 prompt and 8,632 output tokens."""
    rng = np.random.default_rng(0)
    prompt_lens = rng.integers(8, 129, W1_NUM_REQUESTS)
    output_lens = rng.integers(8, 257, W1_NUM_REQUESTS)
    # Drawn after both length arrays, in request order: the definition fixes this order.
    prompts = [rng.integers(1000, 40000, n).tolist() for n in prompt_lens]
    return [
        BenchRequest(prompt, int(out)) for prompt, out in zip(prompts, output_lens, strict=True)
    ]


def random_requests(
    num: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocabulary: np.ndarray,
    seed: int = 0,
) -> list[BenchRequest]:
    """Lengths uniform in the inclusive ranges; token ids drawn from vocabulary."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(input_range[0], input_range[1] + 1, num)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, num)
    return [
        BenchRequest(rng.choice(vocabulary, n).tolist(), int(out))
        for n, out in zip(prompt_lens, output_lens, strict=True)
    ]


def shared_prefix_requests(
    num: int,
    prefix_len: int,
    suffix_range: tuple[int, int],
    output_range: tuple[int, int],
    vocabulary: np.ndarray,
    seed: int = 0,
    num_prefixes: int = 1,
) -> list[BenchRequest]:
    """A common prefix of prefix_len tokens (one of num_prefixes, drawn at random per request, as
    many system prompts or documents would be), then a unique random suffix per request."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.choice(vocabulary, prefix_len).tolist() for _ in range(num_prefixes)]
    groups = np.random.default_rng(seed + 2).integers(0, num_prefixes, num)
    suffixes = random_requests(num, suffix_range, output_range, vocabulary, seed + 1)
    return [
        BenchRequest(prefixes[group] + s.prompt_token_ids, s.output_len)
        for group, s in zip(groups, suffixes, strict=True)
    ]


def load_tokenizer(path: str | Path | None):
    """The tokenizer at path, or the default model's when path is None."""
    from transformers import AutoTokenizer

    if path is None:
        from pagedserve.model.source import resolve_model_dir

        path = resolve_model_dir(None)
    return AutoTokenizer.from_pretrained(path)


def ordinary_token_ids(tokenizer) -> np.ndarray:
    """Every token id but the special ones, which a server may treat differently."""
    special = set(tokenizer.all_special_ids)
    return np.array([t for t in range(len(tokenizer)) if t not in special])


def text_with_length(
    tokenizer, token_ids: list[int], length: int, vocabulary: np.ndarray, max_rounds: int = 8
) -> str:
    """Text that the tokenizer encodes to exactly `length` tokens, starting from token_ids.

    Decoding random ids and encoding the text again merges or splits tokens, so the ids are
    re-encoded, cut or topped up from vocabulary until the count holds (or max_rounds pass).
    """
    rng = np.random.default_rng(length)
    text = tokenizer.decode(token_ids)
    for _ in range(max_rounds):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            break
        ids = ids[:length] + rng.choice(vocabulary, max(0, length - len(ids))).tolist()
        text = tokenizer.decode(ids)
    return text


def chat_template_overhead(tokenizer) -> int:
    """Tokens the chat template adds around one user message (0 without a template)."""
    if tokenizer.chat_template is None:
        return 0
    empty = [{"role": "user", "content": ""}]
    return len(
        tokenizer.apply_chat_template(
            empty, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def parse_range(text: str) -> tuple[int, int]:
    """'8:128' is 8 to 128 inclusive; '64' is exactly 64."""
    low, _, high = text.partition(":")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"a length range must be MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return bounds


@dataclass
class DatasetSpec:
    name: str = "random"
    num_prompts: int = 64
    input_len: tuple[int, int] = (8, 128)  # the suffix after the prefix, for shared-prefix
    output_len: tuple[int, int] = (8, 256)
    prefix_len: int = 256
    num_prefixes: int = 1  # shared-prefix: distinct prefixes the requests are spread over
    seed: int = 0


def build_requests(spec: DatasetSpec, tokenizer=None) -> list[BenchRequest]:
    """The spec's requests; random and shared-prefix draw from the tokenizer's ordinary tokens,
    w1 is cut to its first num_prompts requests."""
    if spec.name == "w1":
        return w1_requests()[: spec.num_prompts]
    if spec.name not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {spec.name!r}")
    vocabulary = ordinary_token_ids(tokenizer)
    if spec.name == "random":
        return random_requests(
            spec.num_prompts, spec.input_len, spec.output_len, vocabulary, spec.seed
        )
    return shared_prefix_requests(
        spec.num_prompts,
        spec.prefix_len,
        spec.input_len,
        spec.output_len,
        vocabulary,
        spec.seed,
        spec.num_prefixes,
    )
