"""The batched sampler alone, on hand-made logits: its draws follow the distribution it is given."""

from __future__ import annotations

import torch

from pagedserve.model import sampler
from pagedserve.model.kernels import cpu_kernels_available
from pagedserve.model.sampler import RandomSampling, SamplingBatch, sample

ROWS = 20000
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _batch(**overrides) -> SamplingBatch:
    fields = dict(
        temperature=torch.full((ROWS,), 1.0),
        top_k=torch.zeros(ROWS, dtype=torch.long),
        top_p=torch.ones(ROWS),
        min_p=torch.zeros(ROWS),
        seeds=torch.arange(ROWS) * 7919 + 13,
        output_index=torch.zeros(ROWS, dtype=torch.long),
        needs_top_k_or_p=False,
        needs_min_p=False,
    )
    return SamplingBatch(random=RandomSampling(**(fields | overrides)))


def _frequencies(batch: SamplingBatch) -> torch.Tensor:
    tokens = sample(LOGITS.expand(ROWS, -1).clone(), batch).tokens
    return torch.bincount(tokens, minlength=len(LOGITS)).float() / ROWS


def test_draws_follow_the_softmax():
    expected = LOGITS.softmax(-1)
    assert torch.allclose(_frequencies(_batch()), expected, atol=0.012)


def test_the_cpu_argmax_kernel_chooses_the_same_tokens():
    assert cpu_kernels_available()
    logits = LOGITS.expand(ROWS, -1).clone()
    for batch in (_batch(), _batch(top_k=torch.full((ROWS,), 3), needs_top_k_or_p=True)):
        drawn = sample(logits, batch).tokens
        assert torch.equal(sample(logits, batch, torch.ops.pagedserve.row_argmax).tokens, drawn)
    greedy = sample(logits, SamplingBatch(), torch.ops.pagedserve.row_argmax).tokens
    assert torch.equal(greedy, torch.zeros(ROWS, dtype=torch.long))


def test_temperature_sharpens_the_distribution():
    cold = _batch(temperature=torch.full((ROWS,), 0.5))
    assert torch.allclose(_frequencies(cold), (LOGITS / 0.5).softmax(-1), atol=0.012)


def test_top_k_and_top_p_keep_only_the_head():
    top_k = _frequencies(_batch(top_k=torch.full((ROWS,), 2), needs_top_k_or_p=True))
    assert top_k[2:].sum() == 0
    assert torch.allclose(top_k[:2], LOGITS[:2].softmax(-1), atol=0.012)
    # The first token holds 0.56 of the mass and the first two 0.77: top_p=0.75 keeps two.
    top_p = _frequencies(_batch(top_p=torch.full((ROWS,), 0.75), needs_top_k_or_p=True))
    assert top_p[2:].sum() == 0
    assert torch.allclose(top_p[:2], LOGITS[:2].softmax(-1), atol=0.012)


def test_min_p_drops_unlikely_tokens():
    # min_p 0.2 of the best token's probability keeps tokens 0, 1 and 2 only.
    frequencies = _frequencies(_batch(min_p=torch.full((ROWS,), 0.2), needs_min_p=True))
    assert frequencies[3:].sum() == 0 and frequencies[2] > 0.05


def test_int32_hash_equals_the_int64_hash_bit_for_bit():
    values = torch.randint(0, 1 << 32, (100000,), dtype=torch.long)
    expected = sampler._mix32(values)
    assert torch.equal(sampler._mix32_int32(sampler._to_int32(values)), sampler._to_int32(expected))
