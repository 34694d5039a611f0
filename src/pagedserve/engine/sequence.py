"""A request as the scheduler sees it: its tokens, how many have KV in the cache, its blocks."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

from pagedserve.outputs import RequestMetrics, SampleLogprobs
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.block_key import BlockKey

_INT64_SPAN = 2**64


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the params' seed, or one drawn for the request so that sampling is a pure function
    max_tokens: int  # params.max_tokens, or what is left of the context when that is None
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)  # prompt then output
    # Tokens whose K and V are in the cache; the rest are computed by the next scheduled steps.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Prefix-cache keys of the full blocks at the head of block_table, once they are registered.
    block_keys: list[BlockKey] = field(default_factory=list)
    sample_index: int = 0  # which of the request's n samples this is
    # Samples still to fork from this one once its prompt is computed (n - 1, then 0).
    pending_forks: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[SampleLogprobs] | None = None  # one per output token, when params ask
    # One per prompt token computed so far, when params ask (None for the first, which nothing
    # predicts); each position's entry is recorded once, even when preemption recomputes it.
    prompt_logprobs: list[SampleLogprobs | None] | None = None
    # The sample's structured-output matcher (an xgrammar GrammarMatcher) when its request has a
    # constraint: it has accepted exactly the output tokens (engine/structured_output.py).
    grammar: Any = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.logprobs is None and self.params.logprobs is not None:
            self.logprobs = []
        if self.prompt_logprobs is None and self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, sample_index: int) -> Sequence:
        """Another sample of the same request, holding the same tokens and block table; the
        caller takes the references on the blocks. Metrics are shared: they are per request."""
        return replace(
            self,
            seed=sample_seed(self.seed, sample_index),
            token_ids=list(self.token_ids),
            block_table=list(self.block_table),
            block_keys=list(self.block_keys),
            sample_index=sample_index,
            pending_forks=0,
            logprobs=None,
            grammar=self.grammar.fork() if self.grammar is not None else None,
        )


def sample_seed(seed: int, sample_index: int) -> int:
    """Sample i of a seeded request draws with seed + i (wrapped to 64 bits): distinct from the
    other samples, and the same on every run."""
    return (seed + sample_index + _INT64_SPAN // 2) % _INT64_SPAN - _INT64_SPAN // 2
