"""The architecture facts the forward pass needs, read from a Hugging Face config.json."""

from __future__ import annotations

import functools
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
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
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
    # Per layer, "sliding_attention" (attending over the last sliding_window positions) or
    # "full_attention", as transformers names them.
    layer_types: tuple[str, ...] = ()
    # The gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU).
    mlp_activation: str = "silu"
    # Gemma's norms: (1 + weight) times the normalised row, folded into the weight at load;
    # each layer's attention and MLP outputs normalised before their residual add.
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float | None = None  # the embeddings are multiplied by it (Gemma: sqrt(hidden))
    attention_scale: float | None = None  # of q.k; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores become cap * tanh(score / cap)
    final_logit_softcap: float | None = None  # the same for the logits
    # RoPE settings per layer type (Gemma 3: local and global layers rotate differently).
    rope_per_layer_type: bool = False
    # The leading dimensions of each head that RoPE rotates (Phi-4-mini: 3/4 of them); None: all.
    rotary_dim: int | None = None
    # Mixture of experts: per layer, whether its MLP is num_experts experts (each a gated MLP of
    # moe_intermediate_size) of which each token takes its router's top num_experts_per_tok,
    # weighted by their softmax probabilities (renormalised over those when norm_topk_prob).
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Qwen2-MoE: beside the routed experts, a gated MLP of this size that every token takes, its
    # output weighted by the sigmoid of its own one-feature gate; 0: none.
    shared_expert_intermediate_size: int = 0
    # config.json as read, for what transformers computes from it (RoPE's frequencies).
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer, None where it attends over the whole context."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def llama_layers(self) -> bool:
        """Whether every layer is Llama's (SwiGLU, two norms, plain softmax over one window for
        all layers, q.k scaled by head_dim ** -0.5): what csrc/decode_layers.cpp computes."""
        return (
            self.mlp_activation == "silu"
            and not self.sandwich_norms
            and self.attn_logit_softcap is None
            and self.attention_scale is None
            and len(set(self.layer_types)) == 1
            and not any(self.moe_layers)
            and self.rotary_dim is None
        )

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
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        # Qwen2 always biases q, k and v; Qwen2-MoE where qkv_bias says so (its default).
        is_qwen2 = architecture == "Qwen2ForCausalLM" or (
            architecture == "Qwen2MoeForCausalLM" and raw.get("qkv_bias", True)
        )
        is_gemma = architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
        attention_bias = bool(raw.get("attention_bias") or False)
        sliding_window = _sliding_window(raw, architecture)
        num_layers = raw["num_hidden_layers"]
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_type=_rope_type(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always biases q, k and v, whatever its config says; its output has none.
            qkv_bias=is_qwen2 or attention_bias,
            output_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias") or False),
            qk_norm=architecture
            in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=sliding_window,
            eos_token_ids=_as_tuple(raw.get("eos_token_id")),
            layer_types=_layer_types(raw, num_layers, sliding_window, is_gemma),
            mlp_activation=_mlp_activation(raw, is_gemma),
            norm_weight_offset=1.0 if is_gemma else 0.0,
            sandwich_norms=is_gemma,
            embed_scale=raw["hidden_size"] ** 0.5 if is_gemma else None,
            attention_scale=raw["query_pre_attn_scalar"] ** -0.5 if is_gemma else None,
            attn_logit_softcap=raw.get("attn_logit_softcapping") if is_gemma else None,
            final_logit_softcap=raw.get("final_logit_softcapping") if is_gemma else None,
            rope_per_layer_type=_rope_per_layer_type(raw),
            rotary_dim=_rotary_dim(raw, head_dim),
            **_experts(raw, architecture, num_layers),
            raw=raw,
        )

    @functools.cached_property
    def transformers_config(self):
        """The transformers config of this model, as its RoPE functions take it; built once."""
        from transformers import AutoConfig

        settings = {key: value for key, value in self.raw.items() if key != "model_type"}
        model_type = self.raw.get("model_type") or MODEL_TYPES[self.architecture]
        return AutoConfig.for_model(model_type, **settings)


def _rope_settings(raw: dict) -> dict:
    # transformers 5 nests RoPE settings in rope_parameters; older configs call them rope_scaling.
    return raw.get("rope_parameters") or raw.get("rope_scaling") or {}


def _rope_per_layer_type(raw: dict) -> bool:
    rope = raw.get("rope_parameters") or {}
    return bool(rope) and all(isinstance(settings, dict) for settings in rope.values())


def _rope_type(raw: dict) -> str:
    """The RoPE type, of the global layers where each layer type has its own settings."""
    rope = _rope_settings(raw)
    if _rope_per_layer_type(raw):
        for settings in rope.values():
            _rope_type({"rope_parameters": settings})
        rope = rope.get("full_attention", next(iter(rope.values())))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; pagedserve supports "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return rope_type


def _rotary_dim(raw: dict, head_dim: int) -> int | None:
    rope = _rope_settings(raw)
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    if rotary_dim == head_dim:
        return None
    if not 0 < rotary_dim < head_dim or rotary_dim % 2:
        raise ValueError(
            f"unsupported partial_rotary_factor {partial}: it must rotate an even number of a "
            f"head's {head_dim} dimensions"
        )
    return rotary_dim


def _layer_types(
    raw: dict, num_layers: int, sliding_window: int | None, is_gemma: bool
) -> tuple[str, ...]:
    if sliding_window is None:
        return ("full_attention",) * num_layers
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    if is_gemma:  # Gemma 2 alternates, starting with a sliding layer
        return tuple(("sliding_attention", "full_attention")[i % 2] for i in range(num_layers))
    return ("sliding_attention",) * num_layers


# The activations of the gated MLP, by the names configs give them.
_MLP_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _mlp_activation(raw: dict, is_gemma: bool) -> str:
    name = (raw.get("hidden_activation") if is_gemma else None) or raw.get("hidden_act", "silu")
    if name not in _MLP_ACTIVATIONS:
        raise ValueError(
            f"unsupported hidden activation {name!r}; pagedserve supports "
            f"{', '.join(_MLP_ACTIVATIONS)}"
        )
    return _MLP_ACTIVATIONS[name]


def _experts(raw: dict, architecture: str, num_layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields: Mixtral's in every layer, Qwen2-MoE's and
    Qwen3-MoE's in every decoder_sparse_step-th layer outside mlp_only_layers (Qwen2-MoE's with
    a shared expert beside the routed ones)."""
    if architecture == "MixtralForCausalLM":
        moe_layers, norm_topk_prob = (True,) * num_layers, True
        intermediate_size = raw["intermediate_size"]
    elif architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
        moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        norm_topk_prob = bool(raw.get("norm_topk_prob", False))
        intermediate_size = raw["moe_intermediate_size"]
    else:
        return {}
    return dict(
        moe_layers=moe_layers,
        num_experts=raw.get("num_local_experts") or raw["num_experts"],
        num_experts_per_tok=raw["num_experts_per_tok"],
        moe_intermediate_size=intermediate_size,
        norm_topk_prob=norm_topk_prob,
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
    )


def _sliding_window(raw: dict, architecture: str) -> int | None:
    if architecture in (
        "MistralForCausalLM",
        "Phi3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "MixtralForCausalLM",
    ):
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
