"""`pagedserve bench sweep`: throughput against latency as max_num_seqs grows.

Each point runs one wave of max_num_seqs identical requests (fixed prompt and output lengths, all
arriving at once), so every request is seated from the first step: TTFT is the prefill of the
whole batch, TPOT the pace of a decode step at that batch size. One engine, built with the largest
max_num_seqs, runs every point: a wave of b requests is scheduled step for step as it would be
under max_num_seqs b, since all b are seated at once either way.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from pagedserve.bench.datasets import BenchRequest
from pagedserve.bench.metrics import Slo
from pagedserve.bench.offline import run_engine, with_fresh_llm
from pagedserve.bench.records import Run
from pagedserve.llm import LLM

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def fixed_requests(num: int, prompt_len: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    return [
        BenchRequest(rng.integers(1000, 40000, prompt_len).tolist(), output_len) for _ in range(num)
    ]


def run_sweep(
    engine_args: dict,
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
    prompt_len: int = 16,
    output_len: int = 16,
) -> list[Run]:
    """One run per batch size."""
    work = partial(
        _run_points, batch_sizes=batch_sizes, prompt_len=prompt_len, output_len=output_len
    )
    return with_fresh_llm(engine_args, work, max_num_seqs=max(batch_sizes))


def _run_points(
    llm: LLM, batch_sizes: tuple[int, ...], prompt_len: int, output_len: int
) -> list[Run]:
    return [
        run_engine(llm, fixed_requests(b, prompt_len, output_len), batch_size=b).summary()
        for b in batch_sizes
    ]


# The policies' target is 90% of the step-count bound, which assumes that every step costs the
# same: where continuous batching's full steps cost 1.17x static batching's draining ones, that
# alone holds it to 85% of the bound. So steps cost "about the same" within 10%, the share of
# the bound the target gives up.
FLAT_TOLERANCE = 1.1


def flat_batch_size(points: list[Run], tolerance: float = FLAT_TOLERANCE) -> int:
    """The largest batch size whose mean decode step costs at most tolerance times the smallest
    batch's: where decode is bound by reading the weights, so every step costs about the same
    whatever it holds, the case the policies' step-count bound assumes."""
    step_s = {
        p.batch_size: p.steps.decode_step_mean_s
        for p in points
        if p.steps is not None and p.steps.decode_step_mean_s is not None
    }
    first = step_s[min(step_s)]
    return max(size for size, seconds in step_s.items() if seconds <= tolerance * first)


def largest_meeting(points: list[Run], slo: Slo) -> Run | None:
    """The point with the largest batch whose p99 TTFT and TPOT meet slo (its e2e is ignored)."""
    meeting = [
        p
        for p in points
        if (slo.ttft is None or (p.ttft_ms is not None and p.ttft_ms.p99 <= slo.ttft))
        and (slo.tpot is None or (p.tpot_ms is not None and p.tpot_ms.p99 <= slo.tpot))
    ]
    return max(meeting, key=lambda p: p.batch_size, default=None)
