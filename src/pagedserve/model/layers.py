"""The small building blocks of a decoder layer: linear maps, RMSNorm, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model.custom_op import CustomOp
from pagedserve.model.linear_method import LinearMethod


class Linear(nn.Module):
    """A linear map whose weights are left uninitialised: they always come from a checkpoint.
    How the weight is stored and multiplied is its method's business (see linear_method.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.method = LinearMethod()

    def use_method(self, method: LinearMethod) -> None:
        """Hands the loaded weight to method, which stores it as it multiplies it."""
        self.method = method
        method.process_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class RMSNorm(CustomOp):
    """norm(x), or with a residual: (norm(residual + x), residual + x), the residual add of a
    decoder layer and the norm after it. The C++ kernel (csrc/norm_activation.cpp) makes one pass
    over each row, and with a residual writes both results in place: x becomes the first,
    residual the second."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = residual = residual + x
        # Normalise in float32 whatever the model dtype, as the reference implementations do.
        normed = self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)
        return normed if residual is None else (normed, residual)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            rows = x.reshape(-1, x.shape[-1])
            return torch.ops.pagedserve.rms_norm(rows, self.weight, self.eps).view(x.shape)
        torch.ops.pagedserve.add_rms_norm_(x, residual, self.weight, self.eps)
        return x, residual


class SiluAndMul(CustomOp):
    """silu(gate) * up, of the two halves of [..., 2 * d]; in C++, one pass over each row."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.pagedserve.silu_and_mul(gate_up)


class SwiGLU(nn.Module):
    """The gated MLP: down(silu(gate(x)) * up(x)), with gate and up fused into one product."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, dtype)
        self.act = SiluAndMul()
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))
