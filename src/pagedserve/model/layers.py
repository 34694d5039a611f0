"""The small building blocks of a decoder layer: linear maps, RMSNorm, the gated MLP and its
mixture of experts."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model.custom_op import CustomOp
from pagedserve.model.gguf_blocks import GGUFPart
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

    def use_method(self, method: LinearMethod, parts: Sequence[GGUFPart] = ()) -> None:
        """Hands the loaded weight (and the GGUF file's blocks of it, where at hand) to method,
        which stores it as it multiplies it."""
        self.method = method
        method.process_weights(self, parts)

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


class GeluTanhAndMul(nn.Module):
    """gelu(gate, tanh approximation) * up, of the two halves of [..., 2 * d] (Gemma's GeGLU)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one product: SwiGLU (silu) or
    GeGLU (gelu_tanh)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        dtype: torch.dtype,
        activation: str = "silu",
    ):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, dtype)
        self.act = SiluAndMul() if activation == "silu" else GeluTanhAndMul()
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """A mixture of gated-MLP experts. The router picks each token's top_k experts; their outputs,
    weighted by the router's softmax probabilities (renormalised over the top_k where asked), are
    summed in the order of the experts; then, where there is one, a shared expert's output is
    added, weighted by the sigmoid of its gate (Qwen2-MoE). Tokens are grouped per expert by one
    sort, and each expert with tokens runs once on all of them: a loop over the experts, none over
    tokens.
    The router's and each expert's maps are Linears, packed for the C++ kernels as a dense
    MLP's are, so that a token's routing and result never depend on its batch."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        dtype: torch.dtype,
        activation: str = "silu",
        shared_intermediate_size: int = 0,
    ):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Linear(hidden_size, num_experts, False, dtype)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, intermediate_size, False, dtype, activation)
            for _ in range(num_experts)
        )
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(
                hidden_size, shared_intermediate_size, False, dtype, activation
            )
            self.shared_expert_gate = Linear(hidden_size, 1, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probabilities = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probabilities, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        # (token, expert) pairs sorted by expert, each expert's tokens in order.
        order = torch.argsort(chosen.flatten(), stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        tokens = (order // self.top_k).split(counts)
        pair_weights = weights.to(x.dtype).flatten()[order].split(counts)
        out = torch.zeros_like(x)
        for expert, rows, row_weights in zip(self.experts, tokens, pair_weights, strict=True):
            if len(rows):
                out.index_add_(0, rows, expert(x[rows]) * row_weights[:, None])
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
