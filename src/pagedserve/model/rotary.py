"""Rotary position embeddings: each position's rotation angles, as the model's config asks.

The inverse frequencies and the attention scaling of every RoPE type (default, linear, dynamic,
llama3, yarn, longrope) come from transformers' own functions (transformers.modeling_rope_utils),
so they are the reference's bits; the cos and sin of every position are tabulated once at load.

Two types depend on a sequence's length in transformers, which decides per forward pass by the
longest position in it. dynamic grows its base only past max_position_embeddings, which the
engine's max_model_len never exceeds, so it keeps its initial frequencies. longrope switches from
its short to its long factors once a sequence is longer than original_max_position_embeddings:
for a request alone that is every prompt token when the prompt is longer, and every later token
from that position on. The same rule is applied per token here (max(prompt length, position + 1)
against the original length), so that a token's angles never depend on the batch or on how its
prompt was chunked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.model.config import ModelConfig


@dataclass
class RotaryAngles:
    """cos and sin of each token's rotation, [tokens, head_dim]: looked up once per step and
    shared by every layer."""

    cos: torch.Tensor
    sin: torch.Tensor

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]; the "rotate half" RoPE layout of Llama, over the leading
        dimensions that cos and sin cover (all, or partial rotary's), the rest passed through."""
        rotary_dim = self.cos.shape[-1]
        if rotary_dim < x.shape[-1]:
            return torch.cat([self.rotate(x[..., :rotary_dim]), x[..., rotary_dim:]], dim=-1)
        first, second = x.chunk(2, dim=-1)
        rotated = torch.cat([-second, first], dim=-1)
        return x * self.cos.unsqueeze(1) + rotated * self.sin.unsqueeze(1)


class RotaryEmbedding(nn.Module):
    """The rotation angles of every position below max_positions, from inv_freq, times scaling.
    With long_inv_freq (longrope), the long factors' angles follow in the same table, taken by
    the tokens of sequences longer than long_after."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        max_positions: int,
        dtype: torch.dtype,
        scaling: float = 1.0,
        long_inv_freq: torch.Tensor | None = None,
        long_after: int | None = None,
    ):
        super().__init__()
        self.max_positions = max_positions
        self.long_after = long_after if long_inv_freq is not None else None
        tables = [_angles(inv_freq, max_positions)]
        if long_inv_freq is not None:
            tables.append(_angles(long_inv_freq, max_positions))
        angles = torch.cat(tables)
        self.register_buffer("cos", (angles.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (angles.sin() * scaling).to(dtype), persistent=False)

    @classmethod
    def from_config(
        cls, config: ModelConfig, dtype: torch.dtype, layer_type: str = "all"
    ) -> RotaryEmbedding:
        """The config's RoPE, with transformers' frequencies and attention scaling; for a model
        whose layer types each have their own (Gemma 3), that of layer_type (else "all")."""
        max_positions = config.max_position_embeddings
        rotary_dim = config.rotary_dim or config.head_dim
        # A config.json that transformers 5 wrote (a GGUF file's metadata among them) states the
        # default RoPE's base itself, read here without transformers' config class (whose import
        # takes about a second of each start).
        stated = config.raw.get("rope_parameters") or {}
        if (
            layer_type == "all"
            and stated.get("rope_type") == "default"
            and "rope_theta" in stated
            and not config.raw.get("rope_scaling")
        ):
            return cls(default_frequencies(rotary_dim, stated["rope_theta"]), max_positions, dtype)
        hf_config = config.transformers_config
        parameters, by_type, rope_type = hf_config.rope_parameters, {}, config.rope_type
        if layer_type != "all":
            parameters, by_type = parameters[layer_type], {"layer_type": layer_type}
            rope_type = parameters.get("rope_type", "default")
        if rope_type == "default":
            theta = parameters["rope_theta"]
            return cls(default_frequencies(rotary_dim, theta), max_positions, dtype)
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        compute = ROPE_INIT_FUNCTIONS[rope_type]
        inv_freq, scaling = compute(hf_config, **by_type)
        if rope_type != "longrope":
            return cls(inv_freq, max_positions, dtype, scaling)
        long_after = parameters["original_max_position_embeddings"]
        long_inv_freq, _ = compute(hf_config, seq_len=long_after + 1, **by_type)
        return cls(inv_freq, max_positions, dtype, scaling, long_inv_freq, long_after)

    def forward(
        self, positions: torch.Tensor, long_prompts: torch.Tensor | None = None
    ) -> RotaryAngles:
        """positions: [tokens]. long_prompts, for longrope: [tokens] whether the token's
        sequence has a prompt longer than the original context."""
        rows = positions
        if self.long_after is not None:
            long = positions >= self.long_after
            if long_prompts is not None:
                long |= long_prompts
            rows = positions + long * self.max_positions
        return RotaryAngles(self.cos[rows], self.sin[rows])


def default_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """The original RoPE's inverse frequencies, [head_dim / 2], as transformers computes them."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def _angles(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    return torch.cat([angles, angles], dim=-1)
