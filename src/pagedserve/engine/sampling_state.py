"""The sampler's per-row tensors, kept from one step to the next while the same sequences sample
in the same order.

A batch of rows is uploaded once: the settings of each row (temperature, top-k/p, min-p, seeds,
logit biases, penalties, min_tokens bans, logprobs) and, for rows with penalties, counts of the
tokens they have seen. While the rows stay the same, a step writes only what moved: every row's
output index goes up by one, and the token each row drew last step is added to its counts. So a
step costs the same however long the histories grow, and the values are the ones a fresh upload
would give. Rows with a structured-output constraint get their allowed tokens afresh every step,
from their matchers.

Invariant: between two steps with the same rows, each row gained exactly the one token the
sampler drew for it (the engine appends every sampled token). Anything else (a row finished,
joined, was preempted or forked) changes the rows and rebuilds the batch.
"""

from __future__ import annotations

import torch

from pagedserve.engine.sequence import Sequence
from pagedserve.engine.structured_output import TokenMasks
from pagedserve.model.sampler import (
    LogprobsRequest,
    PenaltyBatch,
    RandomSampling,
    SamplingBatch,
)


class SamplingState:
    def __init__(self, device: torch.device, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.device, self.vocab_size, self.eos_token_ids = device, vocab_size, eos_token_ids
        self._rows: list[Sequence] = []
        self._num_outputs = 0  # the rows' output tokens, summed, when the batch was last used
        self._batch = SamplingBatch()
        self._output_index: torch.Tensor | None = None  # [rows] long, when some row needs it
        self._bans: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._drawn: torch.Tensor | None = None  # [rows] long: last step's tokens
        self._masks: TokenMasks | None = None  # when some row has a constraint

    def batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """The sampling batch of these rows for this step."""
        num_outputs = sum(seq.num_output_tokens for seq in seqs)
        same = len(seqs) == len(self._rows) and all(
            a is b for a, b in zip(seqs, self._rows, strict=True)
        )
        if same and self._drawn is not None and num_outputs == self._num_outputs + len(seqs):
            self._advance()
        else:
            self._build(seqs)
        if self._masks is not None:
            self._batch.allowed = self._masks.fill()
        self._rows, self._num_outputs, self._drawn = list(seqs), num_outputs, None
        return self._batch

    def drawn(self, tokens: torch.Tensor) -> None:
        """The tokens the sampler drew for this step's rows, one per row."""
        self._drawn = tokens

    def _advance(self) -> None:
        batch = self._batch
        if self._output_index is not None:
            self._output_index += 1
        if batch.penalties is not None:
            rows = self._penalty_rows  # only rows with a penalty keep counts
            batch.penalties.counts[rows, self._drawn[rows]] += 1
            batch.penalties.seen[rows, self._drawn[rows]] = True
        if self._bans is not None:
            batch.banned = self._banned()

    def _build(self, seqs: list[Sequence]) -> None:
        params = [seq.params for seq in seqs]
        device = self.device
        greedy = all(p.greedy for p in params)
        needs_index = any(p.min_tokens > 0 for p in params) or not greedy
        self._output_index = None
        if needs_index:
            outputs = [seq.num_output_tokens for seq in seqs]
            self._output_index = torch.tensor(outputs, device=device)
        self._bans = self._ban_table(seqs)
        constrained = [
            (row, seq.grammar) for row, seq in enumerate(seqs) if seq.grammar is not None
        ]
        self._masks = TokenMasks(constrained, len(seqs), self.vocab_size) if constrained else None
        random = None
        if not greedy:
            random = RandomSampling(
                temperature=torch.tensor([p.temperature for p in params], device=device),
                top_k=torch.tensor([max(p.top_k, 0) for p in params], device=device),
                top_p=torch.tensor([p.top_p for p in params], device=device),
                min_p=torch.tensor([p.min_p for p in params], device=device),
                seeds=torch.tensor([seq.seed for seq in seqs], device=device),
                output_index=self._output_index,
                needs_top_k_or_p=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
                needs_min_p=any(p.min_p > 0.0 for p in params),
            )
        logprob_rows = [row for row, p in enumerate(params) if p.logprobs is not None]
        logprobs = None
        if logprob_rows:
            num_top = max(params[row].logprobs for row in logprob_rows)
            logprobs = LogprobsRequest(torch.tensor(logprob_rows, device=device), num_top)
        self._batch = SamplingBatch(
            bias=self._biases(params),
            banned=self._banned() if self._bans is not None else None,
            random=random,
            penalties=self._penalties(seqs),
            logprobs=logprobs,
        )

    def _biases(self, params: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(rows, token ids, biases) of every row's logit_bias; None when no row sets one."""
        rows, tokens, biases = [], [], []
        for row, p in enumerate(params):
            if p.logit_bias:
                rows += [row] * len(p.logit_bias)
                tokens += list(p.logit_bias)
                biases += list(p.logit_bias.values())
        if not rows:
            return None
        device = self.device
        return (
            torch.tensor(rows, device=device),
            torch.tensor(tokens, device=device),
            torch.tensor(biases, dtype=torch.float32, device=device),
        )

    def _ban_table(self, seqs: list[Sequence]):
        """(rows, token ids, min_tokens) of every stop token a row may not draw before its
        min_tokens; None when no row sets min_tokens."""
        rows, tokens, limits = [], [], []
        for row, seq in enumerate(seqs):
            if seq.params.min_tokens > 0:
                stops = (*self.eos_token_ids, *seq.params.stop_token_ids)
                rows += [row] * len(stops)
                tokens += stops
                limits += [seq.params.min_tokens] * len(stops)
        if not rows:
            return None
        return tuple(torch.tensor(values, device=self.device) for values in (rows, tokens, limits))

    def _banned(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The bans that hold this step: rows still short of their min_tokens."""
        assert self._bans is not None and self._output_index is not None
        rows, tokens, limits = self._bans
        holding = self._output_index[rows] < limits
        if not bool(holding.any()):
            return None
        return rows[holding], tokens[holding]

    def _penalties(self, seqs: list[Sequence]) -> PenaltyBatch | None:
        """None unless some row uses a penalty. The repetition penalty counts prompt and output
        tokens as seen; frequency and presence count output tokens only."""
        params = [seq.params for seq in seqs]
        if not any(p.uses_penalties for p in params):
            return None
        device, vocab = self.device, self.vocab_size
        rows = [row for row, p in enumerate(params) if p.uses_penalties]
        self._penalty_rows = torch.tensor(rows, dtype=torch.long, device=device)
        seen = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=device)
        counts = torch.zeros(len(seqs), vocab, device=device)
        for row, (seq, p) in enumerate(zip(seqs, params, strict=True)):
            if not p.uses_penalties:
                continue
            outputs = torch.tensor(seq.output_token_ids, dtype=torch.long, device=device)
            counts[row].index_add_(0, outputs, torch.ones(len(outputs), device=device))
            history = seq.token_ids if p.repetition_penalty != 1.0 else seq.output_token_ids
            seen[row, torch.tensor(history, dtype=torch.long, device=device)] = True
        return PenaltyBatch(
            presence=torch.tensor([p.presence_penalty for p in params], device=device),
            frequency=torch.tensor([p.frequency_penalty for p in params], device=device),
            repetition=torch.tensor([p.repetition_penalty for p in params], device=device),
            seen=seen,
            counts=counts,
        )
