"""The C++ CPU kernels equal plain torch: decode attention over the same paged cache, linear maps
from packed weights, RMSNorm, SwiGLU, the rotation with the cache write, and argmax over rows."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import rounded_to_q8

import pagedserve
from pagedserve.model.kernels import build_directory_of, cpu_kernels_available
from pagedserve.model.rotary import RotaryEmbedding, default_frequencies


def _reference(query, k_cache, v_cache, tables, context_lens, window):
    """Softmax attention of each sequence's one query over its cached tokens, in float64."""
    num_heads, block_size = query.shape[1], k_cache.shape[1]
    outputs = []
    for seq, length in enumerate(context_lens.tolist()):
        positions = torch.arange(max(0, length - window) if window else 0, length)
        slots = tables[seq, positions // block_size] * block_size + positions % block_size
        keys = k_cache.flatten(0, 1)[slots].double()  # [tokens, kv_heads, dim]
        values = v_cache.flatten(0, 1)[slots].double()
        group = num_heads // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        q = query[seq].double()
        scores = torch.einsum("hd,thd->ht", q, keys) * q.shape[-1] ** -0.5
        outputs.append(torch.einsum("ht,thd->hd", scores.softmax(-1), values))
    return torch.stack(outputs)


def _paged_decode_inputs(num_seqs, num_blocks, width, cache_shape, num_heads, dtype):
    """Random queries, caches ([blocks, *cache_shape]) and shuffled block tables."""
    generator = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * width]
    k_cache = torch.randn(num_blocks, *cache_shape, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, *cache_shape, generator=generator).to(dtype)
    query = torch.randn(num_seqs, num_heads, cache_shape[-1], generator=generator).to(dtype)
    return query, k_cache, v_cache, tables.view(num_seqs, width)


def _assert_matches_reference(out, query, k_cache, v_cache, tables, context_lens, window):
    expected = _reference(query, k_cache, v_cache, tables, context_lens, window)
    tolerance = 1e-5 if query.dtype == torch.float32 else 2e-2
    assert out.dtype == query.dtype
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "window", "dtype"),
    [
        (9, 3, 64, 0, torch.float32),  # SmolLM2's shape
        (20, 2, 20, 0, torch.float32),  # groups of 10 heads; a head_dim beyond whole vectors
        (4, 4, 32, 0, torch.float32),  # no grouping
        (6, 6, 20, 0, torch.float32),  # no grouping, sets of heads across KV heads, tail dims
        (8, 2, 16, 21, torch.float32),  # sliding window
        (9, 3, 64, 0, torch.bfloat16),
    ],
)
def test_decode_attention_matches_plain_attention(num_heads, num_kv_heads, head_dim, window, dtype):
    assert cpu_kernels_available(), "the C++ kernels must build on this machine"
    context_lens = torch.tensor([1, 4, 5, 17, 30, 2])
    # 64 blocks of 4 tokens, 8 per table: enough for 30 tokens.
    inputs = _paged_decode_inputs(6, 64, 8, (4, num_kv_heads, head_dim), num_heads, dtype)

    out = torch.ops.pagedserve.paged_decode_attention(*inputs, context_lens, head_dim**-0.5, window)

    _assert_matches_reference(out, *inputs, context_lens, window)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_takes_float32_queries_on_a_narrower_cache(cache_dtype):
    """--kv-cache-dtype under a float32 model: the cache holds rounded keys and values, and the
    arithmetic is float32, so the output is float32 attention over the values the cache holds."""
    assert cpu_kernels_available()
    context_lens = torch.tensor([1, 4, 5, 17, 30, 2])
    query, k_cache, v_cache, tables = _paged_decode_inputs(6, 64, 8, (4, 3, 64), 9, torch.float32)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)

    out = torch.ops.pagedserve.paged_decode_attention(
        query, k_cache, v_cache, tables, context_lens, 64**-0.5, 0
    )

    assert out.dtype == torch.float32
    expected = _reference(query, k_cache, v_cache, tables, context_lens, 0)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("window", "dtype"), [(0, torch.float32), (700, torch.float32), (0, torch.bfloat16)]
)
def test_decode_attention_merges_the_chunks_of_long_contexts(window, dtype):
    """Contexts beyond 512 tokens are attended in chunks on separate tasks and merged; each
    sequence's result is the same bits alone as beside others."""
    assert cpu_kernels_available()
    kernel = torch.ops.pagedserve.paged_decode_attention
    context_lens = torch.tensor([1, 512, 513, 1100, 1600])
    # 500 blocks of 16 tokens, 100 per table.
    query, k_cache, v_cache, tables = _paged_decode_inputs(5, 500, 100, (16, 3, 64), 9, dtype)
    scale = 64**-0.5

    out = kernel(query, k_cache, v_cache, tables, context_lens, scale, window)

    _assert_matches_reference(out, query, k_cache, v_cache, tables, context_lens, window)
    for seq in range(5):
        rows = slice(seq, seq + 1)
        alone = kernel(
            query[rows], k_cache, v_cache, tables[rows], context_lens[rows], scale, window
        )
        assert torch.equal(alone, out[rows])


def test_decode_attention_rejects_mismatched_inputs():
    assert cpu_kernels_available()
    kernel = torch.ops.pagedserve.paged_decode_attention
    cache = torch.zeros(4, 4, 2, 8)
    tables = torch.zeros(1, 1, dtype=torch.long)
    lens = torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="heads must divide"):
        kernel(torch.zeros(1, 3, 8), cache, cache, tables, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="int64"):
        kernel(torch.zeros(1, 4, 8), cache, cache, tables.int(), lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="outside its block table"):
        kernel(torch.zeros(1, 4, 8), cache, cache, tables, lens + 4, 1.0, 0)
    with pytest.raises(RuntimeError, match="block 4 is not in the cache"):
        kernel(torch.zeros(1, 4, 8), cache, cache, tables + 4, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="caches must share a dtype"):
        kernel(torch.zeros(1, 4, 8), cache, cache.bfloat16(), tables, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="got BFloat16 query, Float and Float caches"):
        kernel(torch.zeros(1, 4, 8, dtype=torch.bfloat16), cache, cache, tables, lens, 1.0, 0)


# The K-quant formats' stored values: (values' bound, inputs a group, the bounds of sc and m,
# their type): Q4_K's 4-bit values and 6-bit sc and m per 32, and Q5_K's 5-bit ones; Q6_K's 6-bit
# values and every int8 sc and m per 16.
_K_QUANTS = {
    "q4_k_q8": (16, 32, (0, 64), torch.uint8),
    "q6_k_q8": (64, 16, (-128, 128), torch.int8),
    "q5_k": (32, 32, (0, 64), torch.uint8),
    "q6_k": (64, 16, (-128, 128), torch.int8),
}


def _packed_weights(out_features, in_features, weight_dtype, generator):
    """(packed panels, per-feature scale or None, the float64 weights they stand for), from
    random stored values: the reference never goes through our quantization."""
    pack = torch.ops.pagedserve
    if weight_dtype == "int8":
        values = torch.randint(-127, 128, (out_features, in_features), generator=generator)
        scale = torch.rand(out_features, generator=generator) / 64
        weight = values.double() * scale.double()[:, None]
        return pack.pack_linear_weight(values.to(torch.int8)), scale, weight
    if weight_dtype in ("q4_1", "q4_1_q8", "q8_0", "q8_0_q8"):
        q8_0 = weight_dtype.startswith("q8_0")
        low, high = (-128, 128) if q8_0 else (0, 16)
        values = torch.randint(low, high, (out_features, in_features), generator=generator)
        groups = (out_features, in_features // 32)
        scales = (torch.rand(groups, generator=generator) / 16).half()
        weight = values.double().view(*groups, 32) * scales.double()[..., None]
        if q8_0:  # pack_q8_0 or pack_q8_0_q8
            packed = getattr(pack, f"pack_{weight_dtype}")(values.to(torch.int8), scales)
        else:
            minima = (torch.randn(groups, generator=generator) / 4).half()
            weight += minima.double()[..., None]
            pack_blocks = getattr(pack, f"pack_{weight_dtype}")  # pack_q4_1 or pack_q4_1_q8
            packed = pack_blocks(values.to(torch.uint8), scales, minima)
        return packed, None, weight.view(out_features, in_features)
    if weight_dtype in ("q5_0", "q5_0_q8"):  # d * (value - 16)
        values = torch.randint(0, 32, (out_features, in_features), generator=generator)
        groups = (out_features, in_features // 32)
        scales = (torch.rand(groups, generator=generator) / 16).half()
        weight = (values.double() - 16).view(*groups, 32) * scales.double()[..., None]
        packed = getattr(pack, f"pack_{weight_dtype}")(values.to(torch.uint8), scales)
        return packed, None, weight.view(out_features, in_features)
    if weight_dtype == "q5_1":  # d * value + minimum
        values = torch.randint(0, 32, (out_features, in_features), generator=generator)
        groups = (out_features, in_features // 32)
        scales = (torch.rand(groups, generator=generator) / 16).half()
        minima = (torch.randn(groups, generator=generator) / 4).half()
        weight = values.double().view(*groups, 32) * scales.double()[..., None]
        weight += minima.double()[..., None]
        packed = pack.pack_q5_1(values.to(torch.uint8), scales, minima)
        return packed, None, weight.view(out_features, in_features)
    if weight_dtype in _K_QUANTS:  # d * sc * value - dmin * m over each group
        top, group, header_bounds, header_type = _K_QUANTS[weight_dtype]
        values = torch.randint(0, top, (out_features, in_features), generator=generator)
        blocks = (out_features, in_features // 256)
        d, dmin = ((torch.rand(blocks, generator=generator) / 256).half() for _ in range(2))
        sc, m = (
            torch.randint(*header_bounds, (*blocks, 256 // group), generator=generator)
            for _ in range(2)
        )
        scales = (d.double()[..., None] * sc).view(out_features, -1, 1)
        minima = (dmin.double()[..., None] * m).view(out_features, -1, 1)
        weight = values.double().view(out_features, -1, group) * scales - minima
        packed = getattr(pack, f"pack_{weight_dtype}")(
            values.to(torch.uint8), d, dmin, sc.to(header_type), m.to(header_type)
        )
        return packed, None, weight.view(out_features, in_features)
    if weight_dtype == "bfloat16_bf16":
        weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
        return pack.pack_bfloat16_bf16(weight), None, weight.double()
    weight = torch.randn(out_features, in_features, generator=generator).to(weight_dtype)
    return pack.pack_linear_weight(weight), None, weight.double()


_SHAPES = [  # (rows, in_features, out_features, with_bias)
    (1, 576, 960, False),  # one decode through SmolLM2's fused qkv
    (13, 64, 48, True),  # two whole tiles of 6 rows and one row; three panels
    (40, 64, 48, True),  # narrow panels widened once for all tiles
    (2, 96, 200, True),  # tiles of 2 rows over 3 panels, then the panels left one by one
    (7, 32, 3, False),
]
_ANY_SHAPES = [  # input features that are not whole groups of 32
    (5, 20, 40, True),  # a last panel with 8 of its 16 features (32 with AVX-512)
    (9, 24, 120, False),  # one whole tile, then 3 rows over 2 panels at a time
    (7, 1, 3, False),
]
_DTYPES = [torch.float32, torch.bfloat16, "int8"]
_BLOCK_DTYPES = ["q4_1", "q8_0", "q5_0", "q5_1"]
# Q4_K's super-blocks take 256 inputs: the shapes above with whole super-blocks.
_SUPER_BLOCK_SHAPES = [(rows, 256 * -(-k // 256), n, bias) for rows, k, n, bias in _SHAPES]


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "with_bias", "weight_dtype"),
    [(*shape, dtype) for shape in _SHAPES + _ANY_SHAPES for dtype in _DTYPES]
    + [(*shape, dtype) for shape in _SHAPES for dtype in _BLOCK_DTYPES]
    + [(*shape, dtype) for shape in _SUPER_BLOCK_SHAPES for dtype in ("q5_k", "q6_k")],
)
def test_packed_linear_matches_plain_product(
    rows, in_features, out_features, with_bias, weight_dtype
):
    """The arithmetic is float32 whatever the panels hold: the reference multiplies the weights
    they stand for (bfloat16: rounded; int8: value times scale; the block formats: each group's
    scale times value, plus its minimum) in float64."""
    assert cpu_kernels_available()
    generator = torch.Generator().manual_seed(0)
    packed, scale, weight = _packed_weights(out_features, in_features, weight_dtype, generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator)

    out = torch.ops.pagedserve.packed_linear(x, packed, out_features, bias, scale)

    expected = x.double() @ weight.T + (bias.double() if with_bias else 0)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)


_INTEGER_DTYPES = ["q4_1_q8", "q8_0_q8", "q5_0_q8"]


@pytest.mark.parametrize(
    ("weight_dtype", "rows", "in_features", "out_features", "with_bias"),
    [(dtype, *shape) for dtype in _INTEGER_DTYPES for shape in _SHAPES]
    + [(dtype, *shape) for dtype in ("q4_k_q8", "q6_k_q8") for shape in _SUPER_BLOCK_SHAPES],
)
def test_integer_products_are_the_dequantized_products_of_rounded_inputs(
    rows, in_features, out_features, with_bias, weight_dtype
):
    """q4_1_q8, q8_0_q8, q5_0_q8, q4_k_q8 and q6_k_q8 round each group of 32 inputs to 8-bit values
    with a float32 scale and compute the dot products with the 4-, 5-, 6- or 8-bit values (all of
    -128 to 127 among them) in integers, exactly: the reference multiplies the weights the blocks
    stand for by the inputs so rounded, in float64. An all-zero group (scale 0) is among them."""
    assert cpu_kernels_available()
    generator = torch.Generator().manual_seed(0)
    packed, _, weight = _packed_weights(out_features, in_features, weight_dtype, generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator)
    x[0, :32] = 0

    out = torch.ops.pagedserve.packed_linear(x, packed, out_features, bias)

    bias_term = bias.double() if with_bias else 0
    values, scales = rounded_to_q8(x)
    expected = (values.double() * scales.double()).view(x.shape) @ weight.T + bias_term
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)
    unrounded = x.double() @ weight.T + bias_term  # what q4_1 or q8_0 computes: rounding shows
    assert not torch.allclose(out.double(), unrounded, atol=1e-4, rtol=1e-5)
    alone = torch.ops.pagedserve.packed_linear(x[-1:], packed, out_features, bias)
    assert torch.equal(alone[0], out[-1])  # a row's outputs whatever shares its tiles


def _vdpbf16ps_steps(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bfloat16_bf16's arithmetic written out in float32: x rounded to bfloat16, then per output
    one sum over the input pairs in order, adding the odd input's product, then the even's."""
    rounded, weight = x.bfloat16().float(), weight.float()
    sums = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(0, x.shape[1], 2):
        sums = sums + rounded[:, k + 1, None] * weight[:, k + 1]
        sums = sums + rounded[:, k, None] * weight[:, k]
    return sums


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "with_bias"),
    [*_SHAPES, (5, 20, 40, True), (9, 2, 130, False)],
)
def test_bfloat16_pairs_are_vdpbf16ps_steps_on_inputs_rounded_to_bfloat16(
    rows, in_features, out_features, with_bias
):
    """bfloat16_bf16 rounds the inputs to bfloat16 and sums each output's exact products pair by
    pair (vdpbf16ps's order, which its AVX2 path keeps): the same bits as that written out in
    torch, on any tile of rows and any strip, a padded one included."""
    assert cpu_kernels_available()
    generator = torch.Generator().manual_seed(0)
    packed, _, weight = _packed_weights(out_features, in_features, "bfloat16_bf16", generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator)

    out = torch.ops.pagedserve.packed_linear(x, packed, out_features, bias)

    expected = _vdpbf16ps_steps(x, weight) + (bias if with_bias else 0)
    assert torch.equal(out, expected)
    unrounded = x.double() @ weight.T + (bias.double() if with_bias else 0)
    assert not torch.allclose(out.double(), unrounded, atol=1e-4, rtol=1e-5)


def test_bfloat16_pairs_reject_mismatched_inputs():
    assert cpu_kernels_available()
    ops, linear = torch.ops.pagedserve, torch.ops.pagedserve.packed_linear
    with pytest.raises(RuntimeError, match="in_features must be even"):
        ops.pack_bfloat16_bf16(torch.zeros(40, 7))
    with pytest.raises(RuntimeError, match="weight must be a 2-D float32 or bfloat16 tensor"):
        ops.pack_bfloat16_bf16(torch.zeros(40, 8, dtype=torch.float16))
    packed = ops.pack_bfloat16_bf16(torch.zeros(40, 8))
    with pytest.raises(RuntimeError, match="is not a pack_bfloat16_bf16 result for 6 input"):
        linear(torch.zeros(2, 6), packed, 40, None)
    with pytest.raises(RuntimeError, match="out_features 70 does not fit 1 strips of 64"):
        linear(torch.zeros(2, 8), packed, 70, None)
    with pytest.raises(RuntimeError, match="bias must be float32 of 40 features"):
        linear(torch.zeros(2, 8), packed, 40, torch.zeros(39))


def _bit_field_products(generator, in_features=576, out_features=200):
    """Products by q4_1, q5_0 and q5_1 panels (values as bit fields), each with the product by
    q8_min panels of the same values, scales and minima (a byte a value; q5_0's minimum
    -16 * scale), on 1, 4, 9 and 40 rows (tiles of each height, and panels widened once)."""
    pack, linear = torch.ops.pagedserve, torch.ops.pagedserve.packed_linear
    groups = (out_features, in_features // 32)
    scales = (torch.rand(groups, generator=generator) / 16).half()
    minima = (torch.randn(groups, generator=generator) / 4).half()
    nibbles, five_bits = (
        torch.randint(0, top, (out_features, in_features), generator=generator).to(torch.uint8)
        for top in (16, 32)
    )
    cases = [
        (pack.pack_q4_1(nibbles, scales, minima), nibbles, minima),
        (pack.pack_q5_0(five_bits, scales), five_bits, (scales.float() * -16).half()),
        (pack.pack_q5_1(five_bits, scales, minima), five_bits, minima),
    ]
    x = torch.randn(40, in_features, generator=generator)
    products = []
    for fields, values, stored_minima in cases:
        as_bytes = pack.pack_q8_min(values.to(torch.int8), scales, stored_minima)
        for rows in (1, 4, 9, 40):
            products.append(
                (linear(x[:rows], fields, out_features, None),
                 linear(x[:rows], as_bytes, out_features, None))
            )  # fmt: skip
    return products


def test_bit_fields_give_the_bits_of_bytes():
    """q4_1's, q5_0's and q5_1's bit fields are read in place against inputs scaled by powers of
    two (exact), so their products are the same bits as q8_min's, whose bytes hold the same
    values."""
    assert cpu_kernels_available()
    for fields, as_bytes in _bit_field_products(torch.Generator().manual_seed(0)):
        assert torch.equal(fields, as_bytes)


@pytest.mark.parametrize(
    "weight_dtype", [*_DTYPES, *_BLOCK_DTYPES, "q5_k", "q6_k", *_INTEGER_DTYPES, "bfloat16_bf16"]
)
def test_packed_linear_rows_do_not_depend_on_the_batch(weight_dtype):
    """Tiles of different heights and widths sum every output in the same order, and panels
    widened once (above 12 rows) hold the values the narrow tiles read in place, so a sequence's
    logits are the same bits whatever else shares its step."""
    assert cpu_kernels_available()
    generator = torch.Generator().manual_seed(0)
    in_features = 256 if weight_dtype in _K_QUANTS else 96  # whole super-blocks
    packed, scale, _ = _packed_weights(200, in_features, weight_dtype, generator)
    bias = torch.randn(200, generator=generator)
    x = torch.randn(20, in_features, generator=generator)
    alone = torch.ops.pagedserve.packed_linear(x[:1], packed, 200, bias, scale)
    for rows in range(2, 21):
        batched = torch.ops.pagedserve.packed_linear(x[:rows], packed, 200, bias, scale)
        assert torch.equal(batched[:1], alone), f"row 0 changed in a batch of {rows}"


@pytest.mark.parametrize("weight_dtype", [torch.float32, "q4_1", *_INTEGER_DTYPES, "bfloat16_bf16"])
@pytest.mark.parametrize("rows", [1, 6])
def test_packed_linear_is_the_same_on_any_number_of_threads(weight_dtype, rows):
    """Threads share the panels (strips for the integer products) in contiguous shares and take
    what the others leave from their ends (csrc/work_sharing.h): every output is computed exactly
    once however many threads there are, more than there are items of work included, and in the
    same order of sums."""
    assert cpu_kernels_available()
    generator = torch.Generator().manual_seed(0)
    packed, scale, _ = _packed_weights(200, 96, weight_dtype, generator)
    x = torch.randn(rows, 96, generator=generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.ops.pagedserve.packed_linear(x, packed, 200, None, scale)
        for num_threads in (2, 3, 16):
            torch.set_num_threads(num_threads)
            out = torch.ops.pagedserve.packed_linear(x, packed, 200, None, scale)
            assert torch.equal(out, alone), f"differs on {num_threads} threads"
    finally:
        torch.set_num_threads(threads)


def test_packed_linear_reads_strided_inputs():
    assert cpu_kernels_available()
    weight, x = torch.randn(24, 10), torch.randn(10, 9).T  # 9 rows, not contiguous
    packed = torch.ops.pagedserve.pack_linear_weight(weight)
    out = torch.ops.pagedserve.packed_linear(x, packed, 24, None)
    torch.testing.assert_close(out, x @ weight.T)


def test_packed_linear_rejects_mismatched_inputs():
    assert cpu_kernels_available()
    packed = torch.ops.pagedserve.pack_linear_weight(torch.randn(40, 8))
    linear = torch.ops.pagedserve.packed_linear
    with pytest.raises(RuntimeError, match="for 7 input features"):
        linear(torch.zeros(2, 7), packed, 40, None)
    with pytest.raises(RuntimeError, match="out_features 70 does not fit"):
        linear(torch.zeros(2, 8), packed, 70, None)
    with pytest.raises(RuntimeError, match="bias must be float32 of 40 features"):
        linear(torch.zeros(2, 8), packed, 40, torch.zeros(39))
    with pytest.raises(RuntimeError, match="input must be a 2-D float32 tensor"):
        linear(torch.zeros(2, 8, dtype=torch.float64), packed, 40, None)
    with pytest.raises(RuntimeError, match="scale is required for int8 panels and only for them"):
        linear(torch.zeros(2, 8), packed, 40, None, torch.ones(40))
    int8_packed = torch.ops.pagedserve.pack_linear_weight(torch.zeros(40, 8, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="scale is required for int8 panels"):
        linear(torch.zeros(2, 8), int8_packed, 40, None)
    with pytest.raises(RuntimeError, match="scale must be float32 of 40 features"):
        linear(torch.zeros(2, 8), int8_packed, 40, None, torch.ones(40, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="weight must be a 2-D float32, bfloat16, float16 or"):
        torch.ops.pagedserve.pack_linear_weight(torch.zeros(4, 4, dtype=torch.float64))


def test_super_block_packers_reject_mismatched_inputs():
    assert cpu_kernels_available()
    ops = torch.ops.pagedserve
    values = torch.zeros(40, 256, dtype=torch.uint8)
    d = torch.ones(40, 1, dtype=torch.float16)
    sc = torch.zeros(40, 1, 8, dtype=torch.uint8)
    ops.pack_q4_k(values, d, d, sc, sc)  # well formed
    with pytest.raises(RuntimeError, match="pack_q4_k: values must be 0-15"):
        ops.pack_q4_k(values + 16, d, d, sc, sc)
    with pytest.raises(RuntimeError, match="128 input features are not whole blocks of 256"):
        ops.pack_q5_k(values[:, :128], d, d, sc, sc)
    with pytest.raises(RuntimeError, match=r"d and dmin must be float16 of shape \[40, 1\]"):
        ops.pack_q4_k(values, d.float(), d, sc, sc)
    with pytest.raises(
        RuntimeError, match=r"sc and m must be Char and Char of shape \[40, 1, 16\]"
    ):
        ops.pack_q6_k(values, d, d, sc, sc)
    with pytest.raises(RuntimeError, match="pack_q5_0: values must be 0-31"):
        ops.pack_q5_0(values[:, :32] + 32, d)


@pytest.mark.parametrize("packer", ["pack_q4_1", "pack_q4_1_q8"])
def test_q4_1_packers_reject_mismatched_inputs(packer):
    assert cpu_kernels_available()
    pack = getattr(torch.ops.pagedserve, packer)
    scales = torch.ones(40, 2, dtype=torch.float16)
    values = torch.zeros(40, 64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=f"{packer}: values must be 0-15"):
        pack(values + 16, scales, scales)
    with pytest.raises(RuntimeError, match="48 input features are not whole groups of 32"):
        pack(values[:, :48], scales[:, :1], scales[:, :1])
    with pytest.raises(RuntimeError, match=r"must be float16 of shape \[40, 2\]"):
        pack(values, scales, scales.float())
    with pytest.raises(RuntimeError, match="values must be a 2-D Byte tensor"):
        pack(values.to(torch.int8), scales, scales)


def test_block_packing_rejects_mismatched_inputs():
    assert cpu_kernels_available()
    pack, linear = torch.ops.pagedserve, torch.ops.pagedserve.packed_linear
    scales = torch.ones(40, 2, dtype=torch.float16)
    values = torch.zeros(40, 64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"must be float16 of shape \[40, 2\]"):
        pack.pack_q8_0(values.to(torch.int8), scales.float())
    for packer in (pack.pack_q8_0, pack.pack_q8_0_q8):
        with pytest.raises(RuntimeError, match="values must be a 2-D Char tensor"):
            packer(values, scales)
        with pytest.raises(RuntimeError, match="48 input features are not whole groups of 32"):
            packer(values[:, :48].to(torch.int8), scales[:, :1])
    packed = pack.pack_q4_1(values, scales, scales)
    with pytest.raises(RuntimeError, match="is not a pack_linear_weight or block packer"):
        linear(torch.zeros(2, 96), packed, 40, None)
    with pytest.raises(RuntimeError, match="is not a pack_linear_weight or block packer"):
        linear(torch.zeros(2, 64), packed.view(-1), 40, None)
    with pytest.raises(RuntimeError, match="scale is required for int8 panels and only for them"):
        linear(torch.zeros(2, 64), packed, 40, None, torch.ones(40))


@pytest.mark.parametrize("weight_dtype", _INTEGER_DTYPES)
def test_integer_products_reject_mismatched_inputs(weight_dtype):
    assert cpu_kernels_available()
    linear = torch.ops.pagedserve.packed_linear
    packed, _, _ = _packed_weights(40, 64, weight_dtype, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=f"is not a pack_{weight_dtype} result for 96 input"):
        linear(torch.zeros(2, 96), packed, 40, None)
    with pytest.raises(RuntimeError, match="out_features 70 does not fit 2 strips of 32"):
        linear(torch.zeros(2, 64), packed, 70, None)
    with pytest.raises(RuntimeError, match="out_features 20 does not fit 2 strips of 32"):
        linear(torch.zeros(2, 64), packed, 20, None)
    with pytest.raises(RuntimeError, match="bias must be float32 of 40 features"):
        linear(torch.zeros(2, 64), packed, 40, torch.zeros(39))
    with pytest.raises(RuntimeError, match="scale is required for int8 panels and only for them"):
        linear(torch.zeros(2, 64), packed, 40, None, torch.ones(40))


@pytest.mark.parametrize("shape", [(1, 576), (7, 20), (3, 2048)])
def test_rms_norm_matches_torch(shape):
    assert cpu_kernels_available()
    generator = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(shape, generator=generator)
    weight = torch.randn(shape[-1], generator=generator)
    out = torch.ops.pagedserve.rms_norm(x, weight, 1e-6)
    expected = weight * F.rms_norm(x, shape[-1:], eps=1e-6)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", [(1, 576), (7, 20), (3, 2048)])
def test_add_rms_norm_updates_both_tensors_in_place(shape):
    """The residual becomes residual + x and x its norm: the same bits as the add followed by the
    separate rms_norm kernel."""
    assert cpu_kernels_available()
    generator = torch.Generator().manual_seed(0)
    x, residual = (3 * torch.randn(shape, generator=generator) for _ in range(2))
    weight = torch.randn(shape[-1], generator=generator)
    expected_sum = residual + x
    expected = torch.ops.pagedserve.rms_norm(expected_sum, weight, 1e-6)
    torch.ops.pagedserve.add_rms_norm_(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_sum)
    assert torch.equal(x, expected)
    torch.testing.assert_close(x, weight * F.rms_norm(expected_sum, shape[-1:], eps=1e-6))


@pytest.mark.parametrize("shape", [(1, 3072), (5, 36), (64, 18)])
def test_silu_and_mul_matches_torch(shape):
    assert cpu_kernels_available()
    gate_up = 4 * torch.randn(shape, generator=torch.Generator().manual_seed(0))
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.ops.pagedserve.silu_and_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-6, rtol=1e-6)


def test_norm_and_activation_reject_mismatched_inputs():
    assert cpu_kernels_available()
    with pytest.raises(RuntimeError, match="weight must be float32 of 8 elements"):
        torch.ops.pagedserve.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous 2-D float32"):
        torch.ops.pagedserve.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="x \\[2, 8\\] and residual \\[3, 8\\] differ"):
        torch.ops.pagedserve.add_rms_norm_(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 0.1)
    with pytest.raises(RuntimeError, match="add_rms_norm_: weight must be float32 of 8"):
        torch.ops.pagedserve.add_rms_norm_(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(4), 0.1)
    with pytest.raises(RuntimeError, match="even width"):
        torch.ops.pagedserve.silu_and_mul(torch.zeros(2, 7))


@pytest.mark.parametrize("size", [49152, 1003, 5])
def test_row_argmax_matches_torch(size):
    """The first of equal maxima, NaN above everything, and rows of -inf, as torch.argmax."""
    assert cpu_kernels_available()
    values = torch.randn(8, size, generator=torch.Generator().manual_seed(0))
    values[1, [size // 3, size - 1]] = 100.0  # a tie: the first wins
    values[2, size - 1] = 100.0  # in the tail beyond whole vectors
    values[3, [0, size // 2]] = float("nan")
    values[4] = float("-inf")
    values[5, size // 2] = float("inf")
    values[6] = 7.0  # every element ties
    out = torch.ops.pagedserve.row_argmax(values)
    assert out.dtype == torch.long
    assert torch.equal(out, values.argmax(dim=-1))
    assert out[1] == size // 3 and out[2] == size - 1 and out[3] == 0 and out[6] == 0
    strided = values[:, : size - 1]
    assert torch.equal(torch.ops.pagedserve.row_argmax(strided), strided.argmax(dim=-1))


def test_row_argmax_rejects_other_inputs():
    assert cpu_kernels_available()
    with pytest.raises(RuntimeError, match="contiguous 2-D float32"):
        torch.ops.pagedserve.row_argmax(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="rows must not be empty"):
        torch.ops.pagedserve.row_argmax(torch.zeros(2, 0))


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "cache_dtype"),
    [
        (9, 3, 64, torch.float32),
        (4, 2, 24, torch.float32),
        (9, 3, 64, torch.bfloat16),
        (4, 2, 24, torch.float16),
    ],
)
def test_rotary_and_cache_matches_torch(num_heads, num_kv_heads, head_dim, cache_dtype):
    """Queries come back rotated; rotated keys and plain values land in their slots (rounded
    once to a narrower cache's dtype), and no other slot changes."""
    assert cpu_kernels_available()
    generator = torch.Generator().manual_seed(0)
    num_tokens, cache_shape = 5, (4, 4, num_kv_heads, head_dim)  # 16 slots
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    rotary = RotaryEmbedding(default_frequencies(head_dim, 10000.0), 64, torch.float32)
    angles = rotary(torch.tensor([0, 3, 7, 8, 60]))
    slots = torch.tensor([2, 15, 0, 9, 4])
    k_cache = torch.randn(cache_shape, generator=generator).to(cache_dtype)
    v_cache = torch.randn(cache_shape, generator=generator).to(cache_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()

    q = torch.ops.pagedserve.rotary_and_cache(
        qkv, angles.cos, angles.sin, k_cache, v_cache, slots, num_heads, num_kv_heads
    )

    heads = qkv.view(num_tokens, -1, head_dim)
    q_heads, k_heads, v_heads = heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    expected_k.view(-1, num_kv_heads, head_dim)[slots] = angles.rotate(k_heads).to(cache_dtype)
    expected_v.view(-1, num_kv_heads, head_dim)[slots] = v_heads.to(cache_dtype)
    torch.testing.assert_close(q, angles.rotate(q_heads), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_cache, expected_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(v_cache, expected_v)


def test_rotary_and_cache_rejects_mismatched_inputs():
    assert cpu_kernels_available()
    angles = RotaryEmbedding(default_frequencies(8, 10000.0), 8, torch.float32)(torch.tensor([0]))
    cache = torch.zeros(2, 4, 1, 8)  # 8 slots, one KV head of 8

    def call(width: int, slot: int, num_heads: int) -> torch.Tensor:
        qkv, slots = torch.zeros(1, width), torch.tensor([slot])
        op = torch.ops.pagedserve.rotary_and_cache
        return op(qkv, angles.cos, angles.sin, cache, cache.clone(), slots, num_heads, 1)

    with pytest.raises(RuntimeError, match="qkv width 40 is not 2 query and 2 x 1 KV heads"):
        call(40, 0, 2)
    with pytest.raises(RuntimeError, match="slot 8 is not in the cache of 8 slots"):
        call(24, 8, 1)
    assert call(32, 7, 2).shape == (1, 2, 8)
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="must be contiguous float32, bfloat16 or float16"):
        call(24, 0, 1)


def test_decode_layers_rejects_a_wrong_weight_list():
    assert cpu_kernels_available()
    hidden, cache = torch.zeros(1, 8), torch.zeros(2, 4, 1, 8)
    angles = RotaryEmbedding(default_frequencies(8, 10000.0), 8, torch.float32)(torch.tensor([0]))

    def call(weights: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.pagedserve.decode_layers(
            hidden, weights, [cache, cache], [cache, cache], angles.cos, angles.sin,
            torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]), 1, 1, 1e-6, 0.35, 0,
        )  # fmt: skip

    with pytest.raises(
        RuntimeError, match="2 layers need 2 value caches and 28 weights, got 2 and 3"
    ):
        call([torch.ones(8)] * 3)
    with pytest.raises(RuntimeError, match="weights\\[0\\] must be a tensor"):
        call([None] * 28)


def test_kernels_load_past_the_lock_of_an_interrupted_build():
    """A build killed midway (Ctrl-C on the first start) leaves torch's `lock` file behind, on
    which torch's loader waits forever: a new process loads the kernels anyway and removes it."""
    assert cpu_kernels_available()
    from torch.utils import cpp_extension

    built = build_directory_of(cpp_extension)  # built already: loading it needs no compiler
    (built / "lock").touch()
    load = "from pagedserve.model.kernels import cpu_kernels_available as a; assert a()"
    subprocess.run([sys.executable, "-c", load], check=True, timeout=300)
    assert not (built / "lock").exists()


def test_a_second_checkout_with_the_same_sources_loads_the_same_build(tmp_path):
    """Kernel builds are named by what they are built from, and compiled from a copy of the
    sources kept with the build: a checkout elsewhere with the same csrc/ loads this build as it
    is, where compiling its own copies (other paths to ninja) would rebuild it."""
    assert cpu_kernels_available()
    from torch.utils import cpp_extension

    built = build_directory_of(cpp_extension)
    library = built / "pagedserve_kernels.so"
    before = library.stat().st_mtime_ns
    checkout = tmp_path / "checkout"
    shutil.copytree(Path(pagedserve.__file__).parent, checkout / "pagedserve")
    load = (
        "import pagedserve, torch.utils.cpp_extension as e\n"
        "from pagedserve.model.kernels import build_directory_of, cpu_kernels_available\n"
        "assert cpu_kernels_available()\n"
        "print(pagedserve.__file__, build_directory_of(e))"
    )
    environment = os.environ | {"PYTHONPATH": str(checkout)}
    loaded = subprocess.run(
        [sys.executable, "-c", load], env=environment, check=True, timeout=300,
        capture_output=True, text=True,
    )  # fmt: skip
    assert loaded.stdout.split() == [str(checkout / "pagedserve" / "__init__.py"), str(built)]
    assert library.stat().st_mtime_ns == before


_INTEGER_PRODUCTS = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_kernels import _bit_field_products, _packed_weights
from pagedserve.model.kernels import _cflags, cpu_kernels_available
assert cpu_kernels_available()
generator = torch.Generator().manual_seed(0)
rows = []
for weight_dtype, inputs in (("q4_1_q8", 576), ("q8_0_q8", 576), ("q5_0_q8", 576),
                              ("bfloat16_bf16", 576), ("q4_k_q8", 512), ("q6_k_q8", 512)):
    packed, _, _ = _packed_weights(200, inputs, weight_dtype, generator)
    x = torch.randn(9, inputs, generator=generator)
    rows += [torch.ops.pagedserve.packed_linear(x[:n], packed, 200, None)[0] for n in (1, 4, 9)]
fields = _bit_field_products(generator)
torch.save({{"rows": rows, "fields": fields, "flags": _cflags()}}, {out!r})
"""


def test_products_give_the_same_bits_with_and_without_avx512_vnni_and_bf16(tmp_path):
    """The integer dot products are exact, so the build for this CPU (with AVX-512 VNNI's
    vpdpbusd where it has it) and an AVX2 build (vpmaddubsw, vpmaddwd; ATEN_CPU_CAPABILITY=avx2
    builds the kernels as for an AVX2-only CPU) compute the same bits, for q4_1_q8, q8_0_q8,
    q5_0_q8, q4_k_q8 and q6_k_q8; bfloat16_bf16's AVX2 path makes AVX-512 BF16's vdpbf16ps steps
    in the same order, so it too gives the same bits. Each build's bit fields give the bits of its
    bytes (test_bit_fields_give_the_bits_of_bytes), the AVX2 build's included."""
    results = {}
    for name, capability in (("host", None), ("avx2", "avx2")):
        out = tmp_path / f"{name}.pt"
        script = _INTEGER_PRODUCTS.format(tests=str(Path(__file__).parent), out=str(out))
        env = os.environ.copy()
        env.pop("ATEN_CPU_CAPABILITY", None)
        if capability is not None:
            env["ATEN_CPU_CAPABILITY"] = capability
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=600)
        results[name] = torch.load(out)
    host, avx2 = results["host"], results["avx2"]
    print(f"this host's build: {' '.join(host['flags'])}")
    assert "-DCPU_CAPABILITY_AVX2" in avx2["flags"]
    assert "-mavx512vnni" not in avx2["flags"] and "-mavx512bf16" not in avx2["flags"]
    for ours, theirs in zip(host["rows"], avx2["rows"], strict=True):
        assert torch.equal(ours, theirs)
    for build in (host, avx2):
        for fields, as_bytes in build["fields"]:
            assert torch.equal(fields, as_bytes)
