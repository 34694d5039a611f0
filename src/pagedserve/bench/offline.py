"""Workloads through LLM.generate in this process, timed and traced step by step.

Every request arrives at the start, so E2E latency includes the time spent waiting for a seat.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from pagedserve.bench.ceilings import model_cost
from pagedserve.bench.datasets import BenchRequest
from pagedserve.bench.metrics import distribution_ms
from pagedserve.bench.records import KvLayout, ModelCost, Run, Setup
from pagedserve.bench.trace import StepRecord, StepRecorder, kv_layout, step_summary
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.llm import LLM
from pagedserve.model.source import gguf_file
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.timing import Stopwatch

T = TypeVar("T")


@dataclass
class EngineSetup:
    """What a run ran on, for a baseline to match and for the ceilings to compare against."""

    model_dir: Path
    dtype: torch.dtype
    device: torch.device
    kv_layout: KvLayout
    cost: ModelCost
    packed_weight_dtype: str | None  # None: the linear weights as loaded, for F.linear
    gguf_path: Path | None = None  # the GGUF file whose metadata model_dir holds (its weights)

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineSetup:
        runner = engine.runner
        packed = runner.packed_weight_dtypes
        return cls(
            engine.model_dir,
            runner.dtype,
            runner.device,
            kv_layout(engine),
            model_cost(runner.model),
            None if packed is None else packed.linear_maps,
            gguf_file(engine.config.model),
        )

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def record(self) -> Setup:
        return Setup(
            model=self.model_dir.name,
            dtype=self.dtype_name,
            device=str(self.device),
            packed_weight_dtype=self.packed_weight_dtype,
            kv_layout=self.kv_layout,
            cost=self.cost,
        )


@dataclass
class OfflineRun:
    name: str
    batch_size: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    e2e_s: list[float]  # per request, from the run's start (every request arrives then)
    ttft_s: list[float] | None = None  # None where the run cannot see first tokens
    tpot_s: list[float] | None = None
    steps: list[StepRecord] = field(default_factory=list)
    started: float = 0.0  # time.monotonic() at the start, the clock of `steps`
    setup: EngineSetup | None = None
    all_reduce_s: float | None = None  # rank 0's time in all-reduces, under tensor parallelism

    def summary(self, **fields) -> Run:
        """The run's figures; fields sets any others (a name, the packed dtype it pinned)."""
        return Run(
            name=self.name,
            batch_size=self.batch_size,
            num_requests=len(self.e2e_s),
            duration_s=self.duration_s,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            output_throughput=self.output_tokens / self.duration_s,
            total_token_throughput=(self.prompt_tokens + self.output_tokens) / self.duration_s,
            e2e_ms=distribution_ms(self.e2e_s),
            ttft_ms=None if self.ttft_s is None else distribution_ms(self.ttft_s),
            tpot_ms=None if self.tpot_s is None else distribution_ms(self.tpot_s),
            steps=step_summary(self.steps) if self.steps else None,
            all_reduce_share=None
            if self.all_reduce_s is None
            else self.all_reduce_s / self.duration_s,
        ).model_copy(update=fields)


def with_fresh_llm(engine_args: dict, work: Callable[[LLM], T], **overrides) -> T:
    """Builds an LLM for one piece of work; it and its KV cache are gone once work returns, so
    that two caches never coexist."""
    llm = LLM(**{**engine_args, **overrides})
    result = work(llm)
    llm.close()
    del llm
    gc.collect()
    return result


def greedy_params(requests: list[BenchRequest]) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]


WARM_UP = BenchRequest(list(range(100, 132)), 4)


def warm_up(llm: LLM) -> None:
    """One short request, so that one-time costs of the first forward are billed to no run."""
    llm.generate(WARM_UP.engine_prompt, greedy_params([WARM_UP]))


def run_engine(llm: LLM, requests: list[BenchRequest], batch_size: int | None = None) -> OfflineRun:
    """Runs requests through llm.generate after a warm-up; every step is recorded. batch_size
    names the run's batch when it is not the engine's max_num_seqs."""
    warm_up(llm)
    engine = llm.engine
    prompts = [r.engine_prompt for r in requests]
    parallel = engine.runner.parallel
    reduced = parallel.seconds_in_all_reduce if parallel is not None else 0.0
    with StepRecorder(engine) as recorder, Stopwatch(engine.runner.device) as watch:
        outputs = llm.generate(prompts, greedy_params(requests))
    return OfflineRun(
        name=engine.config.scheduler,
        batch_size=batch_size or engine.config.max_num_seqs,
        duration_s=watch.seconds,
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        e2e_s=[o.metrics.finished_time - o.metrics.arrival_time for o in outputs],
        ttft_s=[o.metrics.first_token_time - o.metrics.arrival_time for o in outputs],
        tpot_s=[tpot for o in outputs if (tpot := _tpot(o)) is not None],
        steps=recorder.records,
        started=recorder.started,
        setup=EngineSetup.of(engine),
        all_reduce_s=None if parallel is None else parallel.seconds_in_all_reduce - reduced,
    )


def _tpot(output: RequestOutput) -> float | None:
    num_tokens = len(output.outputs[0].token_ids)
    if num_tokens < 2:
        return None
    m = output.metrics
    return (m.finished_time - m.first_token_time) / (num_tokens - 1)
