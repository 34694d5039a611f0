"""The small building blocks of a decoder layer: linear maps, RMSNorm, rotary embeddings, SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model.kernels import cpu_kernels_available
from pagedserve.model.quantization import quantize_int8, quantize_q4_1, quantize_q8_0


def can_use_cpu_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """The packed product and the kernels that go with it (RMSNorm, SwiGLU, rotation) are for
    float32 on CPU; elsewhere torch's own operators are used."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_kernels_available()


@dataclass
class PackedWeight:
    """A linear weight ([out, in]) reordered once, at load time, into the panels the C++ product
    streams (csrc/packed_linear.cpp). The panels hold float32 or bfloat16 weights, int8 values
    with a float32 scale per output feature, or llama.cpp's Q4_1 or Q8_0 blocks (4-bit or 8-bit
    values in groups of 32 inputs, each with a float16 scale, and for Q4_1 a minimum); the
    arithmetic is float32 in every case but q4_1_q8's, whose Q4_1 blocks are computed in integers
    against inputs rounded to 8 bits."""

    panels: torch.Tensor
    out_features: int
    scale: torch.Tensor | None  # int8 panels: weight[j] = scale[j] * value[j]

    @classmethod
    def pack(cls, weight: torch.Tensor, dtype: str) -> PackedWeight:
        """dtype: float32, bfloat16 (weights rounded), int8 (each output feature quantized
        symmetrically), q4_1 or q8_0 (see pagedserve.model.quantization), or q4_1_q8 (Q4_1, as
        csrc/q4_1_q8_linear.cpp computes it)."""
        weight = weight.detach().float()
        if dtype in ("q4_1", "q4_1_q8"):
            panels = getattr(torch.ops.pagedserve, f"pack_{dtype}")(*quantize_q4_1(weight))
            return cls(panels, weight.shape[0], None)
        if dtype == "q8_0":
            panels = torch.ops.pagedserve.pack_q8_0(*quantize_q8_0(weight))
            return cls(panels, weight.shape[0], None)
        scale = None
        if dtype == "int8":
            weight, scale = quantize_int8(weight)
        panels = torch.ops.pagedserve.pack_linear_weight(weight.to(getattr(torch, dtype)))
        return cls(panels, weight.shape[0], scale)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [rows, in] float32 -> [rows, out_features]."""
        return torch.ops.pagedserve.packed_linear(
            x, self.panels, self.out_features, bias, self.scale
        )


class Linear(nn.Module):
    """A linear map whose weights are left uninitialised: they always come from a checkpoint."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.packed_weight: PackedWeight | None = None

    def pack_weight(self, dtype: str) -> None:
        """Replaces the loaded weight with its packed copy, stored as dtype (see PackedWeight)."""
        self.packed_weight = PackedWeight.pack(self.weight, dtype)
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return self.packed_weight(x, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.fused = False  # one C++ call (csrc/norm_activation.cpp): float32 on CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            rows = x.reshape(-1, x.shape[-1])
            return torch.ops.pagedserve.rms_norm(rows, self.weight, self.eps).view(x.shape)
        # Normalise in float32 whatever the model dtype, as the reference implementations do.
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)
        return self.weight * normed

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add of a decoder layer and the norm
        after it. Fused, both happen in place, in one pass: x becomes the first, residual the
        second."""
        if self.fused:
            torch.ops.pagedserve.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self(residual), residual


@dataclass
class RotaryAngles:
    """cos and sin of each token's rotation, [tokens, head_dim]: looked up once per step and
    shared by every layer."""

    cos: torch.Tensor
    sin: torch.Tensor

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]; the "rotate half" RoPE layout of Llama."""
        first, second = x.chunk(2, dim=-1)
        rotated = torch.cat([-second, first], dim=-1)
        return x * self.cos.unsqueeze(1) + rotated * self.sin.unsqueeze(1)


class RotaryEmbedding(nn.Module):
    """The rotation angles of every position up to the model's maximum."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> RotaryAngles:
        """positions: [tokens]."""
        return RotaryAngles(self.cos[positions], self.sin[positions])


class SwiGLU(nn.Module):
    """The gated MLP: down(silu(gate(x)) * up(x)), with gate and up fused into one product."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype)
        self.fused = False  # one C++ call (csrc/norm_activation.cpp): float32 on CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            return self.down_proj(torch.ops.pagedserve.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
