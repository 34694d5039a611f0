"""GGUF blocks of float weights, for tests: the gguf package's own quantizers for the types it
has (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), and a plain one here for the K-quants it lacks (Q4_K, Q5_K,
Q6_K): each group's range mapped onto the type's values, in llama.cpp's block layout. Any such
blocks are valid; the tests compare with gguf's dequantization of the same bytes, not with these
weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from pagedserve.bench.kquants import rewrite_gguf
from pagedserve.model.source import default_gguf_path


def quantize(weights: np.ndarray, type_name: str) -> np.ndarray:
    """uint8 [rows, bytes per row]: float32 weights [rows, in] as GGUF type_name's blocks."""
    weights = np.asarray(weights, dtype=np.float32)
    encoder = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}.get(type_name)
    if encoder is None:
        return gguf.quants.quantize(weights, gguf.GGMLQuantizationType[type_name])
    rows, inputs = weights.shape
    blocks = encoder(weights.reshape(rows * inputs // 256, 256))
    return blocks.reshape(rows, -1)


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(len(values), 2)


def _divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(denominator == 0, 0, numerator / denominator)


def _scales_and_minima(groups: np.ndarray, top: int):
    """Q4_K's and Q5_K's: per block d, dmin (float16) and per group of 32 a 6-bit sc and m,
    with the values (0 to top) that weight ~ d * sc * value - dmin * m gives."""
    low = np.minimum(groups.min(axis=-1), 0)
    scale = (groups.max(axis=-1) - low) / top
    d = (scale.max(axis=-1) / 63).astype(np.float16)
    dmin = ((-low).max(axis=-1) / 63).astype(np.float16)
    sc = np.clip(np.round(_divide(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_divide(-low, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    shift = dmin.astype(np.float32)[:, None] * m
    values = np.round(_divide(groups + shift[..., None], step[..., None]))
    return d, dmin, sc, m, np.clip(values, 0, top).astype(np.uint8)


def _pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes that hold 8 6-bit sc and m (gguf's Q4_K.get_scale_min reads them)."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([first, second, third], axis=1).astype(np.uint8)


def _low_nibbles(values: np.ndarray) -> np.ndarray:
    """[blocks, 8, 32] values -> 128 bytes: group 2c's low halves, group 2c + 1's high."""
    low = values.reshape(-1, 4, 2, 32) & 15
    return (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, values = _scales_and_minima(blocks.reshape(-1, 8, 32), 15)
    return np.concatenate(
        [_f16(d), _f16(dmin), _pack_scale_min(sc, m), _low_nibbles(values)], axis=1
    )


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, values = _scales_and_minima(blocks.reshape(-1, 8, 32), 31)
    high = (values >> 4).astype(np.uint8)  # [blocks, group, input]
    qh = (high << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate(
        [_f16(d), _f16(dmin), _pack_scale_min(sc, m), qh, _low_nibbles(values)], axis=1
    )


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    groups = blocks.reshape(-1, 16, 16)
    scale = np.abs(groups).max(axis=-1) / 31
    d = (scale.max(axis=-1) / 127).astype(np.float16)
    sc = np.clip(np.round(_divide(scale, d.astype(np.float32)[:, None])), -128, 127)
    step = d.astype(np.float32)[:, None] * sc
    values = np.clip(np.round(_divide(groups, step[..., None])), -32, 31).astype(np.int16) + 32
    # values [blocks, half, quarter, 32]: ql byte (quarter % 2) * 32 + i of the half holds
    # quarter's value i in its low (quarter < 2) or high half; qh byte i bits 2q, 2q + 1.
    values = values.reshape(-1, 2, 4, 32).astype(np.uint8)
    low = values & 15
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2
    ).reshape(-1, 128)
    high = values >> 4
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate(
        [ql, qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), _f16(d)], axis=1
    ).astype(np.uint8)


def requantized_default_gguf(path: Path, type_of: Callable[[str, str], str]) -> Path:
    """Writes the default model's GGUF file to path with each tensor stored as
    type_of(its name, its type) (e.g. "Q4_K", "BF16"), quantized again from its weights; the
    metadata is copied as it is."""

    def requantized(tensor) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
        data, stored = tensor.data, tensor.tensor_type
        wanted = gguf.GGMLQuantizationType[type_of(tensor.name, stored.name)]
        if wanted == stored:
            return data, stored
        return quantize(gguf.quants.dequantize(data, stored), wanted.name), wanted

    rewrite_gguf(default_gguf_path(), path, requantized)
    return path


def mixed_type(name: str, stored: str) -> str:
    """Every block type somewhere in the default model: layer i's maps by i % 3 (its down
    projection's 1536 inputs are whole super-blocks of 256, the others' 576 are not)."""
    if not name.startswith("blk.") or stored == "F32":
        return stored
    layer, kind = int(name.split(".")[1]), name.split(".")[2]
    mixes = (
        {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q5_1", "attn_output": "Q5_0",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_K"},
        {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q8_0",
         "ffn_gate": "Q5_1", "ffn_up": "Q5_0", "ffn_down": "Q6_K"},
        {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q5_0", "attn_output": "Q4_0",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q5_K"},
    )  # fmt: skip
    return mixes[layer % 3][kind]
