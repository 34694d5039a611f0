"""Batched sampling: one set of tensor operations picks the next token of every sequence.

Order per step: logit biases, the structured-output masks, min_tokens bans, then penalties
(repetition, frequency, presence); from those logits come both the optional logprobs and the
choice (greedy argmax, or temperature, top-k, top-p, min-p and the draw).

Randomness comes from a counter-based hash of (seed, output index, token id) rather than a
generator's state, so a seeded request draws the same tokens whatever else shares its batch,
and no per-request generator has to be stepped in a Python loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9


@dataclass
class PenaltyBatch:
    """Penalty settings and token counts of every row; only built when some row uses one."""

    presence: torch.Tensor  # [rows] float; 0 means off
    frequency: torch.Tensor  # [rows] float; 0 means off
    repetition: torch.Tensor  # [rows] float; 1 means off
    # [rows, vocab] bool: tokens the repetition penalty applies to (prompt and output tokens).
    seen: torch.Tensor
    # [rows, vocab] float: how often each token is in the row's output, for presence and
    # frequency (prompt tokens count for neither).
    counts: torch.Tensor


@dataclass
class LogprobsRequest:
    """Which rows want logprobs and how many alternatives the widest of them asked for."""

    rows: torch.Tensor  # [m] long
    num_top: int  # the largest `logprobs` among those rows; each row keeps its own prefix


@dataclass
class LogprobsTensors:
    """Logprobs of the rows in LogprobsRequest.rows, in that order."""

    chosen_logprob: torch.Tensor  # [m] float
    chosen_rank: torch.Tensor  # [m] long, 1 for the most likely token
    top_ids: torch.Tensor  # [m, num_top] long, most likely first
    top_logprobs: torch.Tensor  # [m, num_top] float


@dataclass
class RandomSampling:
    """Draw settings of every row; only built when some row samples at random (temperature > 0)."""

    temperature: torch.Tensor  # [rows] float; 0 means greedy
    top_k: torch.Tensor  # [rows] long; 0 means no limit
    top_p: torch.Tensor  # [rows] float in (0, 1]
    min_p: torch.Tensor  # [rows] float in [0, 1]
    seeds: torch.Tensor  # [rows] long, 64-bit seeds
    output_index: torch.Tensor  # [rows] long: how many tokens the sequence has generated so far
    needs_top_k_or_p: bool
    needs_min_p: bool


@dataclass
class SamplingBatch:
    """One row per sequence that samples this step. Each optional part is None when no row
    needs it, so a greedy batch builds no tensor for them."""

    # (rows, token ids, biases): added to those logits (logit_bias)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) never drawn
    # (rows, [rows, ceil(vocab / 32)] int32 bitmask): in those rows, only tokens whose bit is set
    # may be drawn (structured outputs; the bitmask is xgrammar's layout)
    allowed: tuple[list[int], torch.Tensor] | None = None
    random: RandomSampling | None = None  # None: every row is greedy
    penalties: PenaltyBatch | None = None
    logprobs: LogprobsRequest | None = None


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [rows] long
    logprobs: LogprobsTensors | None


def torch_row_argmax(values: torch.Tensor) -> torch.Tensor:
    return values.argmax(dim=-1)


RowArgmax = Callable[[torch.Tensor], torch.Tensor]


def sample(
    logits: torch.Tensor, batch: SamplingBatch, row_argmax: RowArgmax = torch_row_argmax
) -> SamplerOutput:
    """logits: [rows, vocab] float32. Returns the chosen token id of each row, and logprobs of
    the rows that asked for them. row_argmax: each row's first largest index, as torch.argmax
    gives it (the C++ kernel, on the CPU, vectorizes what torch compares one value at a
    time)."""
    if batch.bias is not None:
        rows, token_ids, biases = batch.bias
        logits = logits.index_put((rows, token_ids), biases, accumulate=True)
    if batch.allowed is not None:
        from xgrammar import apply_token_bitmask_inplace  # loaded once a request is constrained

        rows, bitmask = batch.allowed
        logits = logits.clone() if batch.bias is None else logits  # the caller's stay as given
        # xgrammar's matchers fill the bitmask in host memory; the logits may be on a GPU.
        apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, torch.tensor(float("-inf"), device=logits.device))
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    tokens = _choose(logits, batch, row_argmax)
    logprobs = None
    if batch.logprobs is not None:
        logprobs = compute_logprobs(logits, tokens, batch.logprobs)
    return SamplerOutput(tokens, logprobs)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyBatch) -> torch.Tensor:
    """vLLM's order: the repetition penalty (HF semantics, prompt and output tokens) first, then
    OpenAI's frequency and presence penalties on output tokens only."""
    seen, counts = penalties.seen, penalties.counts
    repetition = penalties.repetition[:, None]
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    logits = logits - penalties.frequency[:, None] * counts
    return logits - penalties.presence[:, None] * (counts > 0).to(logits.dtype)


def compute_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, request: LogprobsRequest
) -> LogprobsTensors:
    """Log-softmax of the logits after bans and penalties but before temperature and top-k/p/
    min-p. vLLM V1 by default reports raw logits and V0 included temperature; this middle
    ground describes the distribution the token was chosen from, yet stays independent of
    how loosely a request samples, and greedy requests get real probabilities, not 0 and 1."""
    logprobs = logits[request.rows].log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[request.rows, None]).squeeze(1)
    # vLLM's rank: how many tokens are at least as likely, the chosen one included.
    rank = (logprobs >= chosen[:, None]).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(request.num_top, dim=-1)
    return LogprobsTensors(chosen, rank, top_ids, top_logprobs)


def _choose(logits: torch.Tensor, batch: SamplingBatch, row_argmax: RowArgmax) -> torch.Tensor:
    greedy_tokens = row_argmax(logits)
    draw = batch.random
    if draw is None:
        return greedy_tokens
    is_greedy = draw.temperature == 0
    temperature = torch.where(is_greedy, 1.0, draw.temperature)
    scaled = logits / temperature[:, None]
    if draw.needs_top_k_or_p:
        scaled = _apply_top_k_top_p(scaled, draw.top_k, draw.top_p)
    if draw.needs_min_p:
        scaled = _apply_min_p(scaled, draw.min_p)
    # Gumbel-max: argmax(logit + Gumbel noise) draws from softmax(logit) exactly.
    uniform = _hashed_uniform(draw.seeds, draw.output_index, logits.shape[-1])
    gumbel = -torch.log(-torch.log(uniform))
    sampled_tokens = row_argmax(scaled + gumbel)
    return torch.where(is_greedy, greedy_tokens, sampled_tokens)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)
    limit = torch.where(top_k > 0, top_k, vocab)
    keep = ranks[None, :] < limit[:, None]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the best token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= mass_before < top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The murmur3 finaliser on 32-bit values in int64: products wrap, the mask keeps 32 bits."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def _mix32_int32(x: torch.Tensor) -> torch.Tensor:
    """_mix32 on int32 tensors, bit for bit: AVX2 multiplies 32-bit lanes natively but has no
    64-bit multiply, so the [rows, vocab] hashing runs several times faster here. The masks turn
    the arithmetic shifts of signed values into logical ones."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _as_int32(0x85EBCA6B)
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * _as_int32(0xC2B2AE35)
    return x ^ ((x >> 16) & 0xFFFF)


def _as_int32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit values -> int32 with the same bits."""
    return ((x ^ 0x80000000) - 0x80000000).to(torch.int32)


@functools.cache
def _token_keys(vocab: int, device: torch.device) -> torch.Tensor:
    tokens = torch.arange(vocab, device=device)
    return _to_int32(_mix32(tokens * _GOLDEN32 & _MASK32))


def _hashed_uniform(seeds: torch.Tensor, output_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """A uniform draw in (0, 1) for every (row, token), a pure function of seed and position."""
    low, high = seeds & _MASK32, (seeds >> 32) & _MASK32
    row_key = _mix32(low ^ _mix32(high))
    row_key = _to_int32(_mix32((row_key + output_index * _GOLDEN32) & _MASK32))
    bits = _mix32_int32(row_key[:, None] ^ _token_keys(vocab, seeds.device)[None, :])
    # 23 bits keep (bits + 0.5) / 2**23 exactly representable and strictly inside (0, 1).
    return (((bits >> 9) & 0x7FFFFF).float() + 0.5) / float(1 << 23)
