"""How a linear map's weight is stored and multiplied: one method per weight format.

A Linear knows only its method: the method turns the loaded weight into what it multiplies with
(process_weights), multiplies (apply) and hands its tensors to the decode-step op
(decode_weights). LinearMethod is F.linear on the weight as loaded, on any device and dtype. The
packed formats feed the C++ product (csrc/packed_linear.cpp, float32 inputs on the CPU), from
panels made once at load time: float32 or bfloat16 weights, int8 values with a scale per output
feature, or llama.cpp's Q4_1 or Q8_0 blocks (4-bit or 8-bit values in groups of 32 inputs, each
with a float16 scale, and for Q4_1 a minimum). The arithmetic is float32 in every case but
q4_1_q8's and q8_0_q8's, whose Q4_1 and Q8_0 blocks are multiplied in integers against inputs
rounded to 8 bits, as llama.cpp computes them (csrc/integer_linear.cpp).

choose_formats is the policy: --packed-weight-dtype auto keeps the checkpoint's own weights
exactly, in the format that stores them.
"""

from __future__ import annotations

from collections.abc import Set
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model.quantization import quantize_int8, quantize_q4_1, quantize_q8_0

# The layer a method serves: a pagedserve.model.layers.Linear (weight, bias, out_features).
Linear = nn.Module


class LinearMethod:
    """F.linear on the weight as loaded."""

    name = "unpacked"

    def process_weights(self, layer: Linear) -> None:
        """Called once, after the checkpoint's weight is loaded into layer.weight."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class PackedLinearMethod(LinearMethod):
    """Panels for the C++ product; layer.weight is replaced by layer.panels (and layer.scale)."""

    def __init__(
        self,
        name: str,
        bytes_per_weight: float,
        stores: str | None = None,
        logits: str | None = None,
    ):
        self.name = name
        # Stored bytes per weight, Q4_1's and Q8_0's float16 scales (and minima) included; int8's
        # one scale per output feature left aside.
        self.bytes_per_weight = bytes_per_weight
        # The checkpoint type (GGUF's or safetensors') this format holds exactly, if any.
        self.stores = stores
        # The output projection's format beside this one.
        self.logits = logits or name

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(panels, scale) of a float32 [out, in] weight."""
        raise NotImplementedError

    def process_weights(self, layer: Linear) -> None:
        layer.panels, layer.scale = self.pack(layer.weight.detach().float())
        layer.weight = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] float32 -> [rows, out_features]."""
        return torch.ops.pagedserve.packed_linear(
            x, layer.panels, layer.out_features, layer.bias, layer.scale
        )

    def decode_weights(self, layer: Linear) -> list[torch.Tensor | None]:
        """What csrc/decode_layers.cpp takes for one linear map: panels, bias, scale."""
        return [layer.panels, layer.bias, layer.scale]


class PackedFloat(PackedLinearMethod):
    """float32 or bfloat16 panels (bfloat16: each weight rounded)."""

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, None]:
        dtype = getattr(torch, self.name)
        return torch.ops.pagedserve.pack_linear_weight(weight.to(dtype)), None


class PackedInt8(PackedLinearMethod):
    """Each output feature quantized symmetrically, with a float32 scale."""

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, scale = quantize_int8(weight)
        return torch.ops.pagedserve.pack_linear_weight(values), scale


class PackedBlocks(PackedLinearMethod):
    """llama.cpp's Q4_1 or Q8_0 blocks (pagedserve.model.quantization), packed by the op of the
    format's name: pack_q4_1, pack_q8_0, or pack_q4_1_q8 and pack_q8_0_q8 (for the integer
    product)."""

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, None]:
        q8_0 = self.name.startswith("q8_0")
        blocks = quantize_q8_0(weight) if q8_0 else quantize_q4_1(weight)
        return getattr(torch.ops.pagedserve, f"pack_{self.name}")(*blocks), None


# 4-bit logits lose the most, and int8 ones with a scale per output feature changed greedy
# outputs that q8_0 ones leave as float32 has them: the Q4_1 formats keep the logits' weights as
# Q8_0, as Q4_1 GGUF files do (q4_1_q8 in integers too, as llama.cpp computes them).
PACKED_FORMATS: dict[str, PackedLinearMethod] = {
    method.name: method
    for method in (
        PackedFloat("float32", 4),
        PackedFloat("bfloat16", 2, stores="BF16"),
        PackedInt8("int8", 1),
        PackedBlocks("q8_0", 34 / 32, stores="Q8_0"),
        PackedBlocks("q8_0_q8", 34 / 32),
        PackedBlocks("q4_1", 20 / 32, stores="Q4_1", logits="q8_0"),
        PackedBlocks("q4_1_q8", 20 / 32, logits="q8_0_q8"),
    )
}


class PackedFormats(NamedTuple):
    linear_maps: str
    logits: str  # the output projection's


def choose_formats(name: str, linear_map_types: Set[str], logits_types: Set[str]) -> PackedFormats:
    """The formats --packed-weight-dtype name packs the linear maps and the logits as, given the
    types the checkpoint stores them in (e.g. {"Q4_1"}, {"BF16"}). auto picks, for each, the
    format that holds those weights exactly in the fewest bytes: the one that stores their single
    type, else float32, which holds any."""
    if name != "auto":
        return PackedFormats(name, PACKED_FORMATS[name].logits)
    return PackedFormats(_exact_format(linear_map_types), _exact_format(logits_types))


def _exact_format(types: Set[str]) -> str:
    if len(types) == 1:
        (stored,) = types
        for method in PACKED_FORMATS.values():
            if method.stores == stored:
                return method.name
    return "float32"
