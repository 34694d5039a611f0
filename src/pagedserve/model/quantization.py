"""Weight-only quantization of linear maps for the packed CPU product (see linear_method.py)."""

from __future__ import annotations

import torch

GROUP_SIZE = 32  # inputs per group of Q4_1 and Q8_0, as in llama.cpp and csrc/packed_linear.cpp


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scale): each output feature (row) of a float32 [out, in] weight quantized
    symmetrically, its largest magnitude mapped to 127; weight ~ scale[:, None] * values."""
    scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    values = (weight / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return values, scale


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, scales, minima): llama.cpp's Q4_1 of a float32 [out, in] weight. Each output
    feature's inputs are cut into groups of 32, each with a float16 scale and minimum:
    weight ~ scale * value + minimum, values 0-15 (uint8 [out, in]; scales and minima float16
    [out, in / 32]). Each group's minimum maps to 0 and its maximum to 15, as llama.cpp
    quantizes, so the weights of a Q4_1 GGUF, dequantized to float32, come back exactly."""
    groups = _groups(weight)
    minima = groups.amin(dim=-1).half()
    scales = ((groups.amax(dim=-1) - minima.float()) / 15).half()
    _check_float16_range(minima, scales)
    divisors = torch.where(scales == 0, 1.0, scales.float())  # a constant group: all values 0
    values = (groups - minima.float()[..., None]) / divisors[..., None]
    values = values.round_().clamp_(0, 15).to(torch.uint8)
    return values.view(weight.shape), scales, minima


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales): llama.cpp's Q8_0 of a float32 [out, in] weight. Each output feature's
    inputs are cut into groups of 32, each with a float16 scale: weight ~ scale * value, values
    -127 to 127 (int8 [out, in]; scales float16 [out, in / 32]). Each group's largest magnitude
    maps to 127, as llama.cpp quantizes, so the weights of a Q8_0 GGUF come back exactly."""
    groups = _groups(weight)
    scales = (groups.abs().amax(dim=-1) / 127).half()
    _check_float16_range(scales)
    divisors = torch.where(scales == 0, 1.0, scales.float())  # an all-zero group: all values 0
    values = (groups / divisors[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return values.view(weight.shape), scales


def _groups(weight: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    if in_features % GROUP_SIZE:
        raise ValueError(
            f"q4_1 and q8_0 need in_features in whole groups of {GROUP_SIZE}, got {in_features}"
        )
    return weight.float().view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)


def _check_float16_range(*tensors: torch.Tensor) -> None:
    if not all(tensor.isfinite().all() for tensor in tensors):
        raise ValueError("q4_1 and q8_0 need weights within float16's range (65504)")
