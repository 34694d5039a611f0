"""A GGUF file's quantized linear maps, read as the file stores them and packed for the C++
product without a float copy.

Each quantization type's blocks are read as integers (values, scales, minima), as gguf's own
dequantization reads them, and handed to the packed format that holds them exactly
(csrc/packed_linear.cpp): Q4_0 and Q4_1 as q4_1, Q5_0 as q5_0, Q5_1 as q5_1, Q8_0 as q8_0, Q4_K
as q4_k, Q5_K as q5_k, Q6_K as q6_k. A format also holds types narrower than its own, so that a
fused map whose parts the file stores in different types (Q4_K_M files keep some value
projections in Q6_K beside Q4_K queries and keys, or in Q8_0 beside Q5_0 ones) is packed exactly
in one: FORMAT_HOLDS (q8_min, 8-bit values with a scale and a minimum, holds every type of
groups of 32).

Rows are the file's own: a map's rows are permuted (llama's queries and keys) and named as
transformers' GGUF loader permutes and names them, by its own functions, so that the packed
weights are those that transformers dequantizes, row for row.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedserve.model.source import (
    EXPERT_TENSOR,
    GGUFTensor,
    GGUFTensorTypes,
    transformers_processor,
)

# The GGUF types each block format holds exactly (a value range and header that contain
# the type's).
FORMAT_HOLDS: dict[str, frozenset[str]] = {
    "q4_1": frozenset({"Q4_0", "Q4_1"}),
    "q5_0": frozenset({"Q4_0", "Q5_0"}),
    "q5_1": frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1"}),
    "q8_0": frozenset({"Q4_0", "Q5_0", "Q8_0"}),
    "q8_min": frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}),
    "q4_k": frozenset({"Q4_K"}),
    "q5_k": frozenset({"Q4_K", "Q5_K"}),
    "q6_k": frozenset({"Q4_K", "Q5_K", "Q6_K"}),
    # In integers, against inputs rounded to 8 bits: q4_k's, q6_k's, q5_0's and q8_0's maps.
    "q4_k_q8": frozenset({"Q4_K"}),
    "q6_k_q8": frozenset({"Q4_K", "Q5_K", "Q6_K"}),
    "q5_0_q8": frozenset({"Q4_0", "Q5_0"}),
    "q8_0_q8": frozenset({"Q4_0", "Q5_0", "Q8_0"}),
}
BLOCK_TYPES = frozenset().union(*FORMAT_HOLDS.values())


@dataclass(frozen=True)
class GGUFPart:
    """One tensor of a linear map as the file stores it."""

    type: str  # e.g. "Q4_K"
    # uint8 [out_features, bytes per row]: a view of the file's memory map, or a copy of its rows
    # reordered as transformers' GGUF loader takes them.
    rows: np.ndarray


@dataclass(frozen=True)
class _GroupBlocks:
    """Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0: weight = d * value + m over each group of 32 inputs.
    Types with no m store value - offset (Q4_0: offset 8, Q5_0: 16), so that d * value +
    (-offset * d) is the same weight, with value + offset unsigned."""

    values: np.ndarray  # int16 [out, in]
    d: np.ndarray  # float16 [out, in / 32]
    m: np.ndarray | None  # float16 [out, in / 32]
    offset: int


@dataclass(frozen=True)
class _SuperBlocks:
    """Q4_K, Q5_K and Q6_K: super-blocks of 256 inputs, weight = d * sc * value - dmin * m over
    each group (of 32: Q4_K, Q5_K; of 16: Q6_K, which has no dmin and m)."""

    values: np.ndarray  # int16 [out, in]
    d: np.ndarray  # float16 [out, in / 256]
    dmin: np.ndarray | None  # float16 [out, in / 256]
    sc: np.ndarray  # int16 [out, in / 256, groups]
    m: np.ndarray | None  # uint8 [out, in / 256, groups]


def _split(blocks: np.ndarray, *sizes: int) -> list[np.ndarray]:
    return np.split(blocks, np.cumsum(sizes), axis=-1)


def _halves(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n] values: the low halves of the bytes, then the high."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0's and Q5_1's 4 bytes of high bits -> [..., 32] of 0 or 16."""
    bits = qh.copy().view(np.uint32)  # little-endian, as GGUF stores them
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4


def _half(part: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float16."""
    return part.copy().view(np.float16)[..., 0]


def _decode_group(type_name: str, blocks: np.ndarray) -> _GroupBlocks:
    out, count, _ = blocks.shape
    m = None
    if type_name == "Q8_0":
        d, qs = _split(blocks, 2)
        values, offset = qs.view(np.int8).astype(np.int16), 0
    elif type_name in ("Q4_0", "Q4_1"):
        d, *rest = _split(blocks, 2, 2) if type_name == "Q4_1" else _split(blocks, 2)
        m, qs = (_half(rest[0]), rest[1]) if type_name == "Q4_1" else (None, rest[0])
        offset = 0 if type_name == "Q4_1" else 8
        values = _halves(qs).astype(np.int16) - offset
    else:  # Q5_0, Q5_1
        d, *rest = _split(blocks, 2, 2, 4) if type_name == "Q5_1" else _split(blocks, 2, 4)
        m, qh, qs = (_half(rest[0]), *rest[1:]) if type_name == "Q5_1" else (None, *rest)
        offset = 0 if type_name == "Q5_1" else 16
        values = (_halves(qs).astype(np.int16) | _fifth_bits(qh)) - offset
    return _GroupBlocks(values.reshape(out, count * 32), _half(d), m, offset)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit sc and m -> two [..., 8]."""
    low, high, extra = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([low & 63, (extra & 15) | ((low >> 6) << 4)], axis=-1)
    m = np.concatenate([high & 63, (extra >> 4) | ((high >> 6) << 4)], axis=-1)
    return sc, m


def _decode_super(type_name: str, blocks: np.ndarray) -> _SuperBlocks:
    out, count, _ = blocks.shape
    if type_name == "Q6_K":
        ql, qh, scales, d = _split(blocks, 128, 64, 16)
        # Each half of 128 values: ql's 64 bytes give values 0-63 (low halves) and 64-127 (high
        # halves); qh's 32 bytes give their 2 high bits, 2 bits for each quarter of 32 values.
        low = ql.reshape(out, count, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
        low = (low & 15).reshape(out, count, 2, 4, 32)
        high = qh.reshape(out, count, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        high = (high & 3).reshape(out, count, 2, 4, 32)
        values = (low | (high << 4)).astype(np.int16) - 32
        sc = scales.view(np.int8).astype(np.int16)
        return _SuperBlocks(values.reshape(out, count * 256), _half(d), None, sc, None)
    d, dmin, scales, rest = _split(blocks, 2, 2, 12)
    qh, qs = _split(rest, 32) if type_name == "Q5_K" else (None, rest)
    # 4 chunks of 32 bytes, each the low halves of group 2c and the high halves of group 2c + 1
    values = (qs.reshape(out, count, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15
    values = values.reshape(out, count, 8, 32).astype(np.int16)
    if qh is not None:  # bit g of byte i: group g's input i
        bits = (qh.reshape(out, count, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
        values |= bits.astype(np.int16) << 4
    sc, m = _scale_min_k4(scales)
    return _SuperBlocks(
        values.reshape(out, count * 256), _half(d), _half(dmin), sc.astype(np.int16), m
    )


def _decode(part: GGUFPart) -> _GroupBlocks | _SuperBlocks:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_inputs, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[part.type]]
    out, row_bytes = part.rows.shape
    blocks = np.ascontiguousarray(part.rows).reshape(out, row_bytes // block_bytes, block_bytes)
    return (
        _decode_super(part.type, blocks)
        if block_inputs == 256
        else _decode_group(part.type, blocks)
    )


def dequantize(part: GGUFPart) -> np.ndarray:
    """The part's weights, float32 [out, in], from its integers (what the packed format holds)."""
    blocks = _decode(part)
    out = blocks.values.shape[0]
    if isinstance(blocks, _GroupBlocks):
        d = np.repeat(blocks.d.astype(np.float32), 32, axis=1)
        weights = d * blocks.values.astype(np.float32)
        if blocks.m is not None:
            weights += np.repeat(blocks.m.astype(np.float32), 32, axis=1)
        return weights
    groups = blocks.sc.shape[-1]
    scale = blocks.d.astype(np.float32)[..., None] * blocks.sc.astype(np.float32)
    scale = np.repeat(scale.reshape(out, -1), 256 // groups, axis=1)
    weights = scale * blocks.values.astype(np.float32)
    if blocks.m is not None:
        minimum = blocks.dmin.astype(np.float32)[..., None] * blocks.m.astype(np.float32)
        weights -= np.repeat(minimum.reshape(out, -1), 256 // groups, axis=1)
    return weights


# Rows packed at a time: the integers decoded on the way take several times the blocks' bytes
# (a 49,152-row output projection's would take hundreds of MB at once). A multiple of every
# panel's height (csrc/packed_linear.cpp's kPanel: 16 or 32 rows), so that the panels of
# consecutive pieces are those of the whole, one after the other.
PACK_ROWS = 4096
_PANEL_ROWS = 64


def pack(format_name: str, parts: Sequence[GGUFPart], rows: int = PACK_ROWS) -> torch.Tensor:
    """Panels of format_name (a FORMAT_HOLDS key) for the parts, concatenated along the output
    features in their order (a fused map's); packed `rows` rows at a time where the parts'
    boundaries fall between panels."""
    outside = {part.type for part in parts} - FORMAT_HOLDS[format_name]
    if outside:
        raise ValueError(
            f"packed weight format {format_name} does not hold GGUF {', '.join(sorted(outside))} "
            f"weights exactly; it holds {', '.join(sorted(FORMAT_HOLDS[format_name]))}"
        )
    if any(len(part.rows) % _PANEL_ROWS for part in parts[:-1]):
        return _pack(format_name, parts)
    if all((part.type, format_name) in _STRAIGHT for part in parts):
        return _pack_straight(format_name, parts)
    pieces = [
        GGUFPart(part.type, part.rows[start : start + rows])
        for part in parts
        for start in range(0, len(part.rows), rows)
    ]
    if len(pieces) == 1:
        return _pack(format_name, pieces)
    return torch.cat([_pack(format_name, [piece]) for piece in pieces])


# (GGUF type, format) packed straight from the file's blocks by one C++ pass
# (pack_k_quant_blocks), with no integers decoded in numpy: the K-quants that make up most of a
# K-quant file's bytes, its Q4_K queries and keys beside Q6_K values, and the same for the integer
# products.
_STRAIGHT = {
    *((type_name, name) for type_name in ("Q4_K", "Q6_K") for name in ("q6_k", "q6_k_q8")),
    ("Q4_K", "q4_k"),
    ("Q4_K", "q4_k_q8"),
}


def _pack_straight(format_name: str, parts: Sequence[GGUFPart]) -> torch.Tensor:
    """The parts' panels, each part's after the previous one's, packed in place by one op."""
    with warnings.catch_warnings():  # the map is read-only; the op only reads it
        warnings.simplefilter("ignore", UserWarning)
        rows = [torch.from_numpy(np.ascontiguousarray(part.rows)) for part in parts]
    return torch.ops.pagedserve.pack_k_quant_blocks(rows, [p.type for p in parts], format_name)


def _pack(format_name: str, parts: Sequence[GGUFPart]) -> torch.Tensor:
    decoded = [_decode(part) for part in parts]
    op = getattr(torch.ops.pagedserve, f"pack_{format_name}")
    if format_name in ("q4_1", "q5_0", "q5_0_q8", "q5_1", "q8_0", "q8_0_q8", "q8_min"):
        return op(*_group_inputs(format_name, decoded))
    return op(*_super_block_inputs(format_name, decoded))


def _group_inputs(format_name: str, decoded: list[_GroupBlocks]) -> list[torch.Tensor]:
    scales = np.concatenate([blocks.d for blocks in decoded])
    if format_name in ("q8_0", "q8_0_q8", "q5_0", "q5_0_q8"):  # d * value, value + 16 for q5_0
        shift, value_type = (0, np.int8) if format_name.startswith("q8_0") else (16, np.uint8)
        values = np.concatenate([blocks.values + shift for blocks in decoded]).astype(value_type)
        return [torch.from_numpy(values), torch.from_numpy(scales)]
    if format_name == "q8_min":  # weight = d * value + m, the values as the types store them
        values = np.concatenate([blocks.values for blocks in decoded]).astype(np.int8)
        minima = np.concatenate([b.m if b.m is not None else np.zeros_like(b.d) for b in decoded])
        return [torch.from_numpy(array) for array in (values, scales, minima)]
    values = np.concatenate([blocks.values + blocks.offset for blocks in decoded]).astype(np.uint8)
    with np.errstate(over="ignore"):
        minima = np.concatenate(
            [b.m if b.m is not None else np.float16(-b.offset) * b.d for b in decoded]
        )
    if not np.isfinite(minima).all():  # -offset * d beyond float16: not this format's weights
        raise ValueError(f"a GGUF scale is too large to hold as {format_name}'s minimum")
    return [torch.from_numpy(array) for array in (values, scales, minima)]


def _super_block_inputs(format_name: str, decoded: list[_SuperBlocks]) -> list[torch.Tensor]:
    """q4_k and q5_k take the blocks as they are. q6_k takes groups of 16, with values 0-63 and
    int8 sc and m: Q6_K's d * sc * (q - 32) as d * sc * (q + 32 - 32) with dmin = 32 * d and
    m = sc, and Q4_K's and Q5_K's groups of 32 as two of 16."""
    sixteens = format_name in ("q6_k", "q6_k_q8")
    groups = 16 if sixteens else 8
    values, d, dmin, sc, m = [], [], [], [], []
    for blocks in decoded:
        repeat = groups // blocks.sc.shape[-1]
        d.append(blocks.d)
        sc.append(np.repeat(blocks.sc, repeat, axis=-1))
        if blocks.m is None:  # Q6_K
            values.append(blocks.values + 32)
            with np.errstate(over="ignore"):
                dmin.append(np.float16(32) * blocks.d)
            m.append(blocks.sc)
        else:
            values.append(blocks.values)
            dmin.append(blocks.dmin)
            m.append(np.repeat(blocks.m, repeat, axis=-1))
    header_type = np.int8 if sixteens else np.uint8
    arrays = (
        np.concatenate(values).astype(np.uint8),
        np.concatenate(d),
        np.concatenate(dmin),
        np.concatenate(sc).astype(header_type),
        np.concatenate(m).astype(header_type),
    )
    if not np.isfinite(arrays[2]).all():  # 32 * d beyond float16
        raise ValueError(f"a GGUF scale is too large to hold as {format_name}'s minimum")
    return [torch.from_numpy(np.ascontiguousarray(array)) for array in arrays]


class GGUFNames:
    """GGUF tensor names -> transformers' parameter names (as recorded with the file's metadata,
    model/source.py), and the transformations transformers' GGUF loader makes on the way (llama's
    queries' and keys' rows permuted, Gemma's norms less one), so that a tensor read here is the
    one it reads: by the rows' orders its processor gave at the file's first start where that is
    all it does, else by the processor itself."""

    def __init__(self, types: GGUFTensorTypes, config: dict):
        """config: the model's config.json, as transformers' config writes it."""
        # The rows' orders the processor gave at the file's first start, where that is all it
        # does: importing it costs a later start a third of a second (transformers.models).
        self.row_orders = types.row_orders
        self.processor = (
            transformers_processor(types.architecture, config) if self.row_orders is None else None
        )
        self.names = types.transformers_names
        # A mixture of experts stores each projection of a layer's experts as one tensor,
        # [experts, out, in], which transformers' loader splits by its processor's own map: by
        # GGUF name, the layer and the projection.
        self.experts: dict[str, tuple[int, str]] = {
            name: (int(match["layer"]), match["proj"])
            for name in types.tensors
            if (match := EXPERT_TENSOR.fullmatch(name))
        }

    def expert_names(self, name: str, count: int) -> list[str]:
        """transformers' (per-expert) names of the experts that an expert tensor stacks."""
        layer, proj = self.experts[name]
        return [f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight" for e in range(count)]

    def process(self, name: str, data: np.ndarray) -> np.ndarray:
        """The tensor of GGUF name `name` (or an expert's matrix of it) as transformers loads it:
        its rows taken in the recorded order, or the processor's result."""
        if self.processor is not None:
            return self.processor.process(weights=data, name=name, parsed_parameters={}).weights
        order = self.row_orders.get(name)
        return data if order is None else data[order]


def _mapped(gguf_path: Path, tensor: GGUFTensor) -> np.ndarray:
    """The tensor's bytes, uint8 [rows, bytes per row], from a memory map of the file."""
    row_bytes = tensor.nbytes // tensor.rows
    return np.memmap(
        gguf_path, np.uint8, mode="r", offset=tensor.offset, shape=(tensor.rows, row_bytes)
    )


def linear_parts(gguf_path: Path, types: GGUFTensorTypes, names: GGUFNames) -> dict[str, GGUFPart]:
    """The file's matrices stored in a block type, by the name transformers gives the
    parameter (e.g. "model.layers.0.self_attn.q_proj.weight"), with their rows permuted as
    transformers' GGUF loader permutes them; read from a memory map of the file (nothing is
    copied but the rows of the tensors it permutes)."""
    parts = {}
    for name, tensor in types.tensors.items():
        if tensor.type in BLOCK_TYPES and name in names.experts:
            rows, per_expert = _mapped(gguf_path, tensor), tensor.shape[1]
            for e, hf_name in enumerate(names.expert_names(name, tensor.shape[0])):
                parts[hf_name] = GGUFPart(tensor.type, rows[e * per_expert : (e + 1) * per_expert])
        elif tensor.type in BLOCK_TYPES and len(tensor.shape) == 2 and name in names.names:
            data = names.process(name, _mapped(gguf_path, tensor))
            parts[names.names[name]] = GGUFPart(tensor.type, data)
    return parts


def float_tensors(
    gguf_path: Path, types: GGUFTensorTypes, names: GGUFNames
) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """Each of the file's tensors transformers loads, by transformers' name, with a function
    that reads it as float32 values in transformers' layout (as its GGUF loader dequantizes
    it), from a memory map of the file: a reader reads the tensors it wants, one at a time."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    def read(name: str, tensor: GGUFTensor, expert: int | None = None) -> torch.Tensor:
        data, shape = _mapped(gguf_path, tensor), tensor.shape
        if expert is not None:  # one expert's matrix of a stacked tensor
            data = data[expert * shape[1] : (expert + 1) * shape[1]]
            shape = shape[1:]
        values = gguf_dequantize(data, GGMLQuantizationType[tensor.type]).reshape(shape)
        values = np.asarray(names.process(name, values), np.float32)
        if not values.flags.writeable:  # an F32 tensor's view of the map: copied off it
            values = values.copy()
        return torch.from_numpy(values)

    for name, tensor in types.tensors.items():
        if name in names.experts:
            for e, hf_name in enumerate(names.expert_names(name, tensor.shape[0])):
                yield hf_name, functools.partial(read, name, tensor, e)
        elif name in names.names:
            yield names.names[name], functools.partial(read, name, tensor)
