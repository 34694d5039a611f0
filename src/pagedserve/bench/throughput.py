"""`pagedserve bench throughput`: a workload through LLM.generate, optionally against
transformers' generate on the same requests, batch size and dtype."""

from __future__ import annotations

from functools import partial

from pagedserve.bench.datasets import BenchRequest
from pagedserve.bench.hf_baseline import run_transformers
from pagedserve.bench.offline import OfflineRun, run_engine, with_fresh_llm


def run_throughput(
    engine_args: dict, requests: list[BenchRequest], baseline: str | None = None
) -> list[OfflineRun]:
    """Our run first, then the baseline's when one is asked for."""
    runs = [with_fresh_llm(engine_args, partial(run_engine, requests=requests))]
    if baseline == "transformers":
        ours = runs[0]
        runs.append(run_transformers(requests, ours.batch_size, ours.setup))
    return runs
