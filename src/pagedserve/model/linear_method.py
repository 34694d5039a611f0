"""How a linear map's weight is stored and multiplied: one method per weight format.

A Linear knows only its method: the method turns the loaded weight into what it multiplies with
(process_weights), multiplies (apply) and hands its tensors to the decode-step op
(decode_weights). LinearMethod is F.linear on the weight as loaded, on any device and dtype. The
packed formats feed the C++ product (csrc/packed_linear.cpp, float32 inputs on the CPU), from
panels made once at load time: float32, bfloat16 or float16 weights, int8 values with a scale per
output feature, or llama.cpp's blocks: Q4_1, Q5_0, Q5_1 or Q8_0 (4-, 5- or 8-bit values in groups
of 32 inputs, each with a float16 scale, and for Q4_1 and Q5_1 a minimum), and the K-quants'
super-blocks of 256 inputs (q4_k, q5_k, q6_k); Q5_0, Q5_1 and the K-quants only from a GGUF file's
own blocks (gguf_blocks.py). The arithmetic is float32 in every case but q4_1_q8's, q8_0_q8's,
q4_k_q8's, q6_k_q8's and q5_0_q8's, whose Q4_1, Q8_0, K-quant and Q5_0 blocks are multiplied in
integers against inputs rounded to 8 bits, as llama.cpp computes them (csrc/integer_linear.cpp),
and bfloat16_bf16's, whose bfloat16 weights meet inputs rounded to bfloat16
(csrc/bf16_linear.cpp: AVX-512 BF16's vdpbf16ps).

choose_format is the policy: --packed-weight-dtype auto keeps each map's weights exactly, as
the checkpoint stores them, in the fewest bytes, and computes with the inputs as they are.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model import gguf_blocks
from pagedserve.model.gguf_blocks import GGUFPart
from pagedserve.model.quantization import quantize_int8, quantize_q4_1, quantize_q8_0

# The layer a method serves: a pagedserve.model.layers.Linear (weight, bias, out_features).
Linear = nn.Module


class LinearMethod:
    """F.linear on the weight as loaded."""

    name = "unpacked"

    def takes(self, parts: Sequence[GGUFPart]) -> bool:
        """Whether process_weights makes the weight from parts alone, with no loaded weight."""
        return False

    def process_weights(self, layer: Linear, parts: Sequence[GGUFPart] = ()) -> None:
        """Called once, after the checkpoint's weight is loaded into layer.weight (unless
        takes(parts)); parts: the GGUF file's blocks of the weight, where it has them."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class PackedLinearMethod(LinearMethod):
    """Panels for the C++ product; layer.weight is replaced by layer.panels (and layer.scale)."""

    def __init__(
        self,
        name: str,
        bytes_per_weight: float,
        stores: str | None = None,
        holds: Set[str] = frozenset(),
        logits: str | None = None,
        rounds_inputs: bool = False,
    ):
        self.name = name
        # Stored bytes per weight, the blocks' scales and minima included; int8's one scale per
        # output feature left aside.
        self.bytes_per_weight = bytes_per_weight
        # The checkpoint type (GGUF's or safetensors') that pack, from the weights as loaded,
        # holds exactly, if any; and the GGUF types whose blocks the format holds exactly.
        self.stores = stores
        self.holds = frozenset(holds)
        # The output projection's format beside this one.
        self.logits = logits or name
        # Whether the product rounds its inputs (to 8 bits or bfloat16): auto never picks it.
        self.rounds_inputs = rounds_inputs

    # Whether pack makes this format from any float32 weight: the K-quants' come only from a
    # GGUF file's blocks.
    packs_floats = True

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(panels, scale) of a float32 [out, in] weight."""
        raise NotImplementedError

    def takes(self, parts: Sequence[GGUFPart]) -> bool:
        """Whether this format holds the file's own blocks (only block formats hold GGUF
        types)."""
        return bool(parts) and {part.type for part in parts} <= self.holds

    def process_weights(self, layer: Linear, parts: Sequence[GGUFPart] = ()) -> None:
        """Packs the file's own blocks where this format holds them (exact, with no float
        step), else the loaded weight."""
        types = {part.type for part in parts}
        if self.takes(parts):
            layer.panels, layer.scale = gguf_blocks.pack(self.name, parts), None
        elif self.packs_floats:
            layer.panels, layer.scale = self.pack(layer.weight.detach().float())
        else:
            stored = ", ".join(sorted(types)) or "not GGUF blocks"
            raise ValueError(
                f"packed_weight_dtype {self.name} is made only from a GGUF file's "
                f"{', '.join(sorted(self.holds))} blocks; this weight is {stored}"
            )
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
    """float32, bfloat16 or float16 panels (the last two: each weight rounded)."""

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, None]:
        dtype = getattr(torch, self.name)
        return torch.ops.pagedserve.pack_linear_weight(weight.to(dtype)), None


class PackedBfloat16Pairs(PackedLinearMethod):
    """bfloat16 weights against each map's inputs rounded to bfloat16, computed by AVX-512 BF16's
    vdpbf16ps where the CPU has it (csrc/bf16_linear.cpp)."""

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.ops.pagedserve.pack_bfloat16_bf16(weight.to(torch.bfloat16)), None


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


class GGUFBlocks(PackedLinearMethod):
    """Q5_0, Q5_1 or Q8_min blocks or the K-quants' super-blocks, made only from a GGUF file's
    blocks."""

    packs_floats = False


# 4-bit logits lose the most, and int8 ones with a scale per output feature changed greedy
# outputs that q8_0 ones leave as float32 has them: the Q4_1 formats keep the logits' weights as
# Q8_0, as Q4_1 GGUF files do (q4_1_q8 in integers too, as llama.cpp computes them).
_HOLDS = gguf_blocks.FORMAT_HOLDS
PACKED_FORMATS: dict[str, PackedLinearMethod] = {
    method.name: method
    for method in (
        PackedFloat("float32", 4),
        PackedFloat("bfloat16", 2, stores="BF16"),
        PackedFloat("float16", 2, stores="F16"),
        PackedBfloat16Pairs("bfloat16_bf16", 2, rounds_inputs=True),
        PackedInt8("int8", 1),
        PackedBlocks("q8_0", 34 / 32, stores="Q8_0", holds=_HOLDS["q8_0"]),
        PackedBlocks("q8_0_q8", 34 / 32, holds=_HOLDS["q8_0_q8"], rounds_inputs=True),
        PackedBlocks("q4_1", 20 / 32, stores="Q4_1", holds=_HOLDS["q4_1"], logits="q8_0"),
        PackedBlocks("q4_1_q8", 20 / 32, logits="q8_0_q8", rounds_inputs=True),
        GGUFBlocks("q5_0", 22 / 32, holds=_HOLDS["q5_0"], logits="q8_0"),
        GGUFBlocks("q5_1", 24 / 32, holds=_HOLDS["q5_1"], logits="q8_0"),
        GGUFBlocks("q8_min", 36 / 32, holds=_HOLDS["q8_min"], logits="q8_0"),
        GGUFBlocks("q4_k", 148 / 256, holds=_HOLDS["q4_k"], logits="q8_0"),
        GGUFBlocks("q5_k", 180 / 256, holds=_HOLDS["q5_k"], logits="q8_0"),
        GGUFBlocks("q6_k", 228 / 256, holds=_HOLDS["q6_k"], logits="q8_0"),
        # A K-quant file's q4_k, q6_k, q5_0 and q8_0 maps in integers (q8_0_q8 above; the others
        # as auto packs them).
        GGUFBlocks("q4_k_q8", 148 / 256, holds=_HOLDS["q4_k_q8"], rounds_inputs=True),
        GGUFBlocks("q6_k_q8", 228 / 256, holds=_HOLDS["q6_k_q8"], rounds_inputs=True),
        GGUFBlocks("q5_0_q8", 22 / 32, holds=_HOLDS["q5_0_q8"], rounds_inputs=True),
    )
}
# The packed weight dtypes that take some maps in integers, the others being packed as auto packs
# them: for each, the formats auto keeps such maps in and the integer formats that replace them.
INTEGER_OF = {
    "q4_k_q8": {"q4_k": "q4_k_q8", "q6_k": "q6_k_q8", "q5_0": "q5_0_q8", "q8_0": "q8_0_q8"}
}


class PackedFormats(NamedTuple):
    """What the linear maps are packed as, for the log: each format in use, sorted, joined by
    "+" (e.g. "q4_k+q6_k"), for the maps and for the output projection."""

    linear_maps: str
    logits: str  # the output projection's


def choose_format(name: str, types: Set[str], logits: bool, from_blocks: bool) -> str:
    """The format --packed-weight-dtype name packs one map as (logits: the output projection),
    given the types the checkpoint stores it in (e.g. {"Q4_1"}, {"Q4_K", "Q6_K"} for a fused map
    of parts in both, {"BF16"}); from_blocks: whether the GGUF file's own blocks are at hand.
    auto picks the format that holds those weights exactly in the fewest bytes: from the blocks
    (a format holds the GGUF types in its holds), or from the weights as loaded (it holds the
    one type it stores); float32 holds any. q4_k_q8 packs as auto, but the maps auto keeps as q4_k,
    q6_k, q5_0 or q8_0 as q4_k_q8, q6_k_q8, q5_0_q8 or q8_0_q8: a K-quant file in integers."""
    if name in INTEGER_OF:
        chosen = choose_format("auto", types, logits, from_blocks)
        return INTEGER_OF[name].get(chosen, chosen)
    if name != "auto":
        return PACKED_FORMATS[name].logits if logits else name
    holders = [
        method
        for method in PACKED_FORMATS.values()
        if not method.rounds_inputs
        and (bool(types) and types <= method.holds if from_blocks else types == {method.stores})
    ]
    return min(holders, key=lambda method: method.bytes_per_weight, default=_FLOAT32).name


_FLOAT32 = PACKED_FORMATS["float32"]
