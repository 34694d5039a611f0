"""What the engine hands back: vLLM's RequestOutput shape, plus the per-step stream deltas."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Times come from time.monotonic(); steps count engine steps from 0."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    first_token_step: int | None = None
    finished_step: int | None = None

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class Logprob:
    """One candidate token at one output position, as vLLM names it."""

    logprob: float
    rank: int | None = None  # 1 for the most likely token
    decoded_token: str | None = None


# One output position: the chosen token and the top `logprobs` alternatives, by token id.
SampleLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort", or "error" (a constraint that admitted no token)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[SampleLogprobs] | None = None  # one per token id; None unless asked for

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # One per prompt token when SamplingParams.prompt_logprobs asks, None for the first.
    prompt_logprobs: list[SampleLogprobs | None] | None = None


@dataclass
class StepOutput:
    """What one engine step produced for one sample of a request: the pieces a stream sends on."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[SampleLogprobs] | None = None  # one per new token id, when asked for
    index: int = 0  # which of the request's n samples (CompletionOutput.index)
    # Set on the step that ends this sample; its result may be released later (under `static`).
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Set once the request's result is released (at once, or at batch end under `static`).
    final: RequestOutput | None = None
    # On a sample's first piece, when the request asked for them: the prompt's logprobs.
    prompt_logprobs: list[SampleLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.final is not None
