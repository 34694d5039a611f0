"""The architecture facts the forward pass needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Each supported architecture and its transformers model_type.
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES)
# RoPE types whose angles transformers' own functions compute (transformers.modeling_rope_utils).
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_type: str
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    output_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    # config.json as read, for what transformers computes from it (RoPE's frequencies).
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def kv_cache_bytes_per_token(self, itemsize: int) -> int:
        """One token's keys and values in every layer, each element itemsize bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {model_dir} has no config.json")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        architectures = raw.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise ValueError(
                f"unsupported architecture {architectures or raw.get('model_type')!r}; "
                f"pagedserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = raw["num_attention_heads"]
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(raw.get("attention_bias") or False)
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_type=_rope_type(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always biases q, k and v, whatever its config says; its output has none.
            qkv_bias=is_qwen2 or attention_bias,
            output_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias") or False),
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(raw, architecture),
            eos_token_ids=_as_tuple(raw.get("eos_token_id")),
            raw=raw,
        )

    def transformers_config(self):
        """The transformers config of this model, as its RoPE functions take it."""
        from transformers import AutoConfig

        settings = {key: value for key, value in self.raw.items() if key != "model_type"}
        model_type = self.raw.get("model_type") or MODEL_TYPES[self.architecture]
        return AutoConfig.for_model(model_type, **settings)


def _rope_type(raw: dict) -> str:
    # transformers 5 nests RoPE settings in rope_parameters; older configs call them rope_scaling.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; pagedserve supports "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(
            f"unsupported partial_rotary_factor {partial}: RoPE over the whole head only"
        )
    return rope_type


def _sliding_window(raw: dict, architecture: str) -> int | None:
    if architecture in ("MistralForCausalLM", "Phi3ForCausalLM"):  # whenever the config sets one
        return raw.get("sliding_window")
    if raw.get("use_sliding_window"):
        raise ValueError(f"{architecture} with use_sliding_window=true is not supported")
    return None


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)
