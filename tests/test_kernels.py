"""The C++ decode attention equals attention computed in plain torch from the same paged cache."""

from __future__ import annotations

import pytest
import torch

from pagedserve.model.kernels import paged_decode_attention


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


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "window", "dtype"),
    [
        (9, 3, 64, 0, torch.float32),  # SmolLM2's shape
        (20, 2, 20, 0, torch.float32),  # groups of 10 heads; a head_dim beyond whole vectors
        (4, 4, 32, 0, torch.float32),  # no grouping
        (8, 2, 16, 21, torch.float32),  # sliding window
        (9, 3, 64, 0, torch.bfloat16),
    ],
)
def test_decode_attention_matches_plain_attention(num_heads, num_kv_heads, head_dim, window, dtype):
    kernel = paged_decode_attention()
    assert kernel is not None, "the C++ kernel must build on this machine"
    generator = torch.Generator().manual_seed(0)
    block_size, num_blocks = 4, 64
    context_lens = torch.tensor([1, 4, 5, 17, 30, 2])
    width = 8  # blocks per table, enough for 30 tokens
    tables = torch.randperm(num_blocks, generator=generator)[: 6 * width].view(6, width)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    query = torch.randn(6, num_heads, head_dim, generator=generator).to(dtype)

    out = kernel(query, k_cache, v_cache, tables, context_lens, head_dim**-0.5, window)

    expected = _reference(query, k_cache, v_cache, tables, context_lens, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_decode_attention_rejects_mismatched_inputs():
    kernel = paged_decode_attention()
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
