"""`pagedserve bench throughput`: a workload through LLM.generate, optionally against
transformers' generate on the same requests and dtype, at our batch size or at others."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from pagedserve.bench.datasets import BenchRequest
from pagedserve.bench.hf_baseline import run_transformers
from pagedserve.bench.offline import OfflineRun, run_engine, with_fresh_llm


def run_throughput(
    engine_args: dict,
    requests: list[BenchRequest],
    baseline: str | None = None,
    baseline_batch_sizes: Sequence[int] = (),
) -> list[OfflineRun]:
    """Our run first, then the baseline's when one is asked for: one run per batch size in
    baseline_batch_sizes, or at our max_num_seqs when it is empty."""
    runs = [with_fresh_llm(engine_args, partial(run_engine, requests=requests))]
    if baseline == "transformers":
        ours = runs[0]
        for batch_size in baseline_batch_sizes or [ours.batch_size]:
            runs.append(run_transformers(requests, batch_size, ours.setup))
    return runs
