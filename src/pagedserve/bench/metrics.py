"""Latency and throughput figures from per-request timestamps, as serving benchmarks define them.

All times are seconds on one monotonic clock (time.perf_counter). Figures are reported in ms.
- TTFT: request sent to the first chunk carrying output.
- ITL: the gaps between consecutive chunks carrying output (a chunk usually holds one token).
- TPOT: (E2E - TTFT) / (output tokens - 1), the decode pace the request saw.
- E2E: request sent to its stream's end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from pagedserve.bench.records import Distribution, Failure, ServeRun

QUANTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestResult:
    start: float
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrivals of chunks with output
    prompt_tokens: int = 0
    output_tokens: int = 0  # as the server's usage chunk counts them
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return np.diff(self.token_times).tolist()

    @property
    def tpot(self) -> float | None:
        """None for a one-token output, which has no decode phase."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class Slo:
    """Service level objectives in ms; a request is good when it meets every one that is set."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """'ttft=500,tpot=50,e2e=10000' (any subset)."""
        values: dict[str, float] = {}
        for part in filter(None, text.split(",")):
            name, _, value = part.partition("=")
            if name.strip() not in ("ttft", "tpot", "e2e") or not value:
                raise ValueError(f"--slo takes ttft=MS,tpot=MS,e2e=MS, got {part!r}")
            values[name.strip()] = float(value)
        return cls(**values)

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if v is not None}

    def met_by(self, result: RequestResult) -> bool:
        measured = {"ttft": result.ttft, "tpot": result.tpot, "e2e": result.e2e}
        return all(
            measured[name] is None or 1000 * measured[name] <= limit
            for name, limit in self.as_dict().items()
        )


def distribution_ms(seconds: Iterable[float]) -> Distribution | None:
    """Mean and percentiles in ms; None when there is nothing to summarize."""
    values = 1000 * np.asarray(list(seconds), dtype=float)
    if values.size == 0:
        return None
    percentiles = {f"p{q}": float(np.percentile(values, q)) for q in QUANTILES}
    return Distribution(mean=float(values.mean()), **percentiles)


def summarize(results: list[RequestResult], duration: float, slo: Slo | None = None) -> ServeRun:
    """The figures of one benchmark run that took `duration` seconds of wall time."""
    done = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary = ServeRun(
        num_requests=len(results),
        completed=len(done),
        failed=len(results) - len(done),
        failures=[
            Failure(index=i, error=r.error) for i, r in enumerate(results) if r.error is not None
        ],
        duration_s=duration,
        total_prompt_tokens=prompt_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(prompt_tokens + output_tokens) / duration,
        ttft_ms=distribution_ms(r.ttft for r in done),
        tpot_ms=distribution_ms(r.tpot for r in done if r.tpot is not None),
        itl_ms=distribution_ms(gap for r in done for gap in r.itls),
        e2e_ms=distribution_ms(r.e2e for r in done),
    )
    if slo is not None and slo.as_dict():
        summary.good_requests = sum(slo.met_by(r) for r in done)
        summary.slo_ms, summary.goodput = slo.as_dict(), summary.good_requests / duration
    return summary
