"""`pagedserve bench report` (what `make bench` runs): every benchmark in one run, one after the
other in one process, written to BENCHMARKS.md with its plots and raw results."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch

from pagedserve.bench import report_sections as sections
from pagedserve.bench import speed_sections
from pagedserve.bench.ceilings import Ceilings, measure_ceilings
from pagedserve.bench.client import Target
from pagedserve.bench.datasets import (
    BenchRequest,
    DatasetSpec,
    build_requests,
    load_tokenizer,
    w1_requests,
)
from pagedserve.bench.llama_cpp_peer import (
    gguf_weight_bytes,
    llama_cpp_installed,
    run_llama_cpp,
    run_llama_cpp_batched,
)
from pagedserve.bench.metrics import Slo
from pagedserve.bench.offline import EngineSetup, OfflineRun, run_engine, with_fresh_llm
from pagedserve.bench.serve import ServeConfig, run_serve_benchmark
from pagedserve.bench.speed import (
    LongPromptLoad,
    StepProfile,
    greedy_agreement,
    profile_decode_steps,
    run_long_prompt_load,
)
from pagedserve.bench.speed_sections import SpeedFigures
from pagedserve.bench.sweep import DEFAULT_BATCH_SIZES, fixed_requests, run_sweep
from pagedserve.bench.throughput import run_throughput
from pagedserve.bench.timeline import Segment, run_seed_scenario
from pagedserve.engine.model_runner import resolve_device
from pagedserve.model.source import gguf_file
from pagedserve.server.process import LocalServer

logger = logging.getLogger(__name__)
POLICIES = ("continuous", "static")
# Packed weight dtypes run beside float32 (--packed-weight-dtype): fewer bytes per decode step.
NARROW_WEIGHT_DTYPES = ("bfloat16", "int8", "q4_1", "q4_1_q8")
T = TypeVar("T")


@dataclass
class ReportConfig:
    model: str | None = None
    dtype: str = "auto"
    # The targets are for weights at full precision (float32 on a CPU without fast bfloat16),
    # not the GGUF's Q4_1 that auto packs; the narrower ones run beside them.
    packed_weight_dtype: str = "float32"
    plots_dir: Path = Path("docs/bench")
    # Below 64, the size of W1, so that requests wait for seats and the policies differ.
    w1_batch_size: int = 16
    # Each policy runs W1 this many times, the policies alternating, and is judged by its fastest
    # run: one busy spell on the shared machine then cannot decide the comparison.
    w1_policy_rounds: int = 2
    # Every W1 request seated at once: the offline figure the HTTP run is compared with.
    w1_all_seated: int = 64
    # Offline and over HTTP each run W1 this many times, taking turns, and each is judged by its
    # fastest run, as the policies are.
    w1_seated_rounds: int = 2
    single_stream: tuple[int, int] = (32, 128)  # prompt and output tokens
    # Each engine runs the single-stream request this many times (ours and transformers taking
    # turns) and is judged by its fastest run: a run takes seconds, so one busy spell on the
    # shared machine could otherwise set a figure alone.
    single_stream_rounds: int = 3
    # float32 against narrower packed weights: W1's first requests, outputs capped at
    # this length.
    agreement_requests: int = 16
    agreement_output_len: int = 64
    profile_batches: tuple[int, ...] = (1, 64)
    long_prompt_load: LongPromptLoad = field(default_factory=LongPromptLoad)
    # The per-step token budget with chunked prefill in the long-prompt benchmark: small enough
    # that a step with a prompt chunk costs at most a few decode steps on this CPU.
    chunked_budget: int = 128
    # transformers' generate is too slow here for all of W1 (about 10 minutes at batch 32), so
    # it runs W1's first requests at each of these batch sizes, beside our engine on the same
    # requests with as many seats; the fastest is its best request-level batching.
    baseline_requests: int = 32
    baseline_batch_sizes: tuple[int, ...] = (8, 16, 32)
    sweep_batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    sweep_prompt_len: int = 16
    sweep_output_len: int = 16
    # About a reader's pace: 5 tokens/s.
    sweep_slo: Slo = field(default_factory=lambda: Slo(tpot=200))
    serve_dataset: DatasetSpec = field(
        default_factory=lambda: DatasetSpec("random", 24, (32, 96), (16, 48))
    )
    serve_rate: float = 1.5
    serve_slo: Slo = field(default_factory=lambda: Slo(ttft=2000, tpot=200))
    threads: int | None = None  # torch's intra-op threads, here and in the server; None: default

    @property
    def engine_args(self) -> dict:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "packed_weight_dtype": self.packed_weight_dtype,
        }


def write_report(config: ReportConfig, output: Path) -> Path:
    started, load_before = time.monotonic(), os.getloadavg()[0]
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    config.plots_dir.mkdir(parents=True, exist_ok=True)
    plots_link = Path(os.path.relpath(config.plots_dir.resolve(), output.parent.resolve()))
    stages = _Stages()
    body, raw = _measure_and_render(config, plots_link, stages)
    minutes = (time.monotonic() - started) / 60
    loads = (load_before, os.getloadavg()[0])
    head = sections.header(date.today(), minutes, loads, stages.seconds)
    output.write_text(head + "\n" + body)
    raw["stage_seconds"] = stages.seconds
    (config.plots_dir / "results.json").write_text(json.dumps(raw, indent=1) + "\n")
    return output


@dataclass
class _Stages:
    """Runs the report's stages one by one, logging each and keeping its wall time."""

    seconds: dict[str, float] = field(default_factory=dict)

    def run(self, name: str, work: Callable[[], T]) -> T:
        logger.info("bench report: %s ...", name)
        started = time.monotonic()
        result = work()
        self.seconds[name] = time.monotonic() - started
        logger.info("bench report: %s took %.0f s", name, self.seconds[name])
        return result


def _measure_and_render(
    config: ReportConfig, plots_link: Path, stages: _Stages
) -> tuple[str, dict]:
    """Runs every benchmark; returns the markdown below the header and the raw figures."""
    engine_args, batch, requests = config.engine_args, config.w1_batch_size, w1_requests()
    measure = partial(measure_ceilings, resolve_device("auto"))
    first_ceilings = stages.run("ceilings", measure)
    all_policy_runs = [
        stages.run(f"W1 {policy} {round_}", partial(_w1_run, config, requests, policy))
        for round_ in range(1, config.w1_policy_rounds + 1)
        for policy in POLICIES
    ]
    durations = {
        policy: [run.duration_s for run in all_policy_runs if run.name == policy]
        for policy in POLICIES
    }
    runs = [
        min((run for run in all_policy_runs if run.name == policy), key=lambda run: run.duration_s)
        for policy in POLICIES
    ]
    setup = runs[0].setup
    baseline = stages.run("transformers baseline", partial(_baseline_runs, config))
    points = stages.run(
        "sweep",
        partial(
            run_sweep,
            engine_args,
            config.sweep_batch_sizes,
            config.sweep_prompt_len,
            config.sweep_output_len,
        ),
    )
    segments = stages.run("seed timeline", partial(_seed_timelines, engine_args))
    serve = stages.run("bench serve", partial(_serve_run, config, setup, batch))
    seated_runs, narrow_kv_runs, narrow_weight_runs, http_runs = _w1_seated_rounds(
        config, requests, stages
    )
    speed = SpeedFigures(
        all_seated_runs=seated_runs,
        narrow_kv_seated_runs=narrow_kv_runs,
        narrow_weight_seated_runs=narrow_weight_runs,
        http_runs=http_runs,
        single_stream=_single_stream_rounds(config, stages),
        llama_cpp=stages.run("llama.cpp", partial(_llama_cpp_runs, config, requests)),
        narrow_weights_agreement=stages.run(
            "narrow weights agreement", partial(_narrow_weights_agreement, config)
        ),
        profiles=stages.run("step profiles", partial(_profile_runs, config)),
        long_prompts=stages.run("long prompts", partial(_long_prompt_runs, config)),
        baseline=baseline,
        policies=runs,
    )
    prefix = stages.run("prefix caching", partial(sections.prefix_caching, engine_args))
    # Measured again last, so that a busy spell at the start cannot set them alone.
    ceilings = Ceilings.best_of([first_ceilings, stages.run("ceilings again", measure)])
    context = sections.Context(config.plots_dir, plots_link, ceilings, setup)
    body = "\n".join(
        [
            sections.machine(context),
            sections.ceilings(context, batch),
            sections.w1_policies(context, runs, durations),
            sections.transformers_baseline(context, baseline),
            sections.kv_usage(context, runs),
            sections.sweep(context, points, config),
            sections.seed_timeline(context, segments),
            sections.serving(context, serve, config, batch),
            prefix,
            speed_sections.speed_targets(context, speed, config),
        ]
    )
    raw = {
        "machine": sections.machine_facts(context),
        "ceilings": ceilings.as_dict(),
        "w1": [run.summary() for run in runs],
        "transformers_baseline": [run.summary() for run in baseline],
        "sweep": points,
        "serve": serve,
        "speed": speed.as_dict(),
    }
    return body, raw


def _w1_run(
    config: ReportConfig,
    requests: list[BenchRequest],
    policy: str,
    seats: int | None = None,
    **engine_args,
) -> OfflineRun:
    work = partial(run_engine, requests=requests)
    return with_fresh_llm(
        config.engine_args,
        work,
        max_num_seqs=seats or config.w1_batch_size,
        scheduler=policy,
        **engine_args,
    )


def _w1_seated_rounds(
    config: ReportConfig, requests: list[BenchRequest], stages: _Stages
) -> tuple[list[OfflineRun], list[OfflineRun], dict[str, list[OfflineRun]], list[dict]]:
    """W1 with every request seated, round after round: offline, offline with a bfloat16 KV
    cache, offline with each packed weight dtype that has a row (SEATED_WEIGHT_ROWS), then over
    HTTP."""
    seated, narrow_kv, http = [], [], []
    narrow_weights: dict[str, list[OfflineRun]] = {
        dtype: [] for dtype in speed_sections.SEATED_WEIGHT_ROWS
    }
    offline = partial(_w1_run, config, requests, "continuous", config.w1_all_seated)
    for round_ in range(1, config.w1_seated_rounds + 1):
        seated.append(stages.run(f"W1 all seated {round_}", offline))
        narrow_kv.append(
            stages.run(
                f"W1 all seated, bfloat16 KV cache {round_}",
                partial(offline, kv_cache_dtype="bfloat16"),
            )
        )
        for dtype, runs in narrow_weights.items():
            runs.append(
                stages.run(
                    f"W1 all seated, {dtype} weights {round_}",
                    partial(offline, packed_weight_dtype=dtype),
                )
            )
        http.append(stages.run(f"W1 over HTTP {round_}", partial(_w1_http_run, config, requests)))
    return seated, narrow_kv, narrow_weights, http


def _w1_http_run(config: ReportConfig, requests: list[BenchRequest]) -> dict:
    """All of W1 streamed at once to a server with every request seated; the summary gains the
    server's peak resident memory."""
    with _server(config, config.w1_all_seated) as server:
        serve_config = ServeConfig(Target(server.base_url), progress=False)
        summary = run_serve_benchmark(serve_config, requests)
        summary["server_peak_rss_bytes"] = server.peak_rss_bytes()
    return summary


def _single_stream_rounds(config: ReportConfig, stages: _Stages) -> list[dict]:
    """The single-stream request through each engine, round after round: each one's fastest
    run, in the order of a round."""
    rounds = [
        stages.run(f"single stream {round_}", partial(_single_stream_round, config))
        for round_ in range(1, config.single_stream_rounds + 1)
    ]
    return [sections.fastest_of_rounds(list(runs)) for runs in zip(*rounds, strict=True)]


def _single_stream_round(config: ReportConfig) -> list[dict]:
    """One request alone through our engine, through transformers' generate, then through our
    engine with each narrower dtype of packed weights."""
    prompt_len, output_len = config.single_stream
    requests = fixed_requests(1, prompt_len, output_len)
    engine_args = {**config.engine_args, "max_num_seqs": 1}
    ours, transformers = (
        run.summary() for run in run_throughput(engine_args, requests, "transformers")
    )
    work = partial(run_engine, requests=requests)
    narrow = [
        with_fresh_llm(engine_args, work, packed_weight_dtype=dtype).summary()
        | {"name": f"ours, {dtype} packed weights", "packed_weight_dtype": dtype}
        for dtype in NARROW_WEIGHT_DTYPES
    ]
    return [ours | {"name": "ours"}, transformers, *narrow]


def _llama_cpp_runs(config: ReportConfig, requests: list[BenchRequest]) -> dict | None:
    """The single-stream request, then all of W1 at once, through llama.cpp on the model's GGUF
    file with as many threads as ours; None when llama-cpp-python is not installed or the model
    is no GGUF file."""
    gguf_path = gguf_file(config.model)
    if gguf_path is None or not llama_cpp_installed():
        return None
    threads = torch.get_num_threads()
    request = fixed_requests(1, *config.single_stream)[0]
    alone = sections.fastest_of_rounds(
        [
            run_llama_cpp(request, gguf_path, threads).summary()
            for _ in range(config.single_stream_rounds)
        ]
    )
    batched = run_llama_cpp_batched(requests, gguf_path, threads)
    return {
        "gguf": gguf_path.name,
        "step_bytes": gguf_weight_bytes(gguf_path),
        "single_stream": alone,
        "w1_all_seated": batched.summary(),
    }


def _narrow_weights_agreement(config: ReportConfig) -> list[dict]:
    """W1's first requests, outputs capped, greedy from float32 and from each narrower dtype of
    packed weights, then from a bfloat16 KV cache."""
    requests = [
        BenchRequest(r.prompt_token_ids, min(r.output_len, config.agreement_output_len))
        for r in w1_requests()[: config.agreement_requests]
    ]
    engine_args = {**config.engine_args, "max_num_seqs": config.agreement_requests}
    variants = [{"packed_weight_dtype": dtype} for dtype in NARROW_WEIGHT_DTYPES]
    variants.append({"kv_cache_dtype": "bfloat16"})
    return greedy_agreement(engine_args, requests, variants)


def _profile_runs(config: ReportConfig) -> list[StepProfile]:
    def work(llm) -> list[StepProfile]:
        return [profile_decode_steps(llm, batch) for batch in config.profile_batches]

    return with_fresh_llm(config.engine_args, work, max_num_seqs=max(config.profile_batches))


def _long_prompt_runs(config: ReportConfig) -> list[dict]:
    """The same load without chunked prefill, then with it under config.chunked_budget."""
    work = partial(run_long_prompt_load, load=config.long_prompt_load)
    return [
        with_fresh_llm(config.engine_args, work, enable_chunked_prefill=False),
        with_fresh_llm(config.engine_args, work, max_num_batched_tokens=config.chunked_budget),
    ]


def _baseline_runs(config: ReportConfig) -> list[OfflineRun]:
    requests = w1_requests()[: config.baseline_requests]
    engine_args = {**config.engine_args, "max_num_seqs": config.baseline_requests}
    return run_throughput(engine_args, requests, "transformers", config.baseline_batch_sizes)


def _seed_timelines(engine_args: dict) -> dict[str, list[Segment]]:
    return {policy: run_seed_scenario(engine_args, policy) for policy in POLICIES}


def _serve_run(config: ReportConfig, setup: EngineSetup, batch: int) -> dict:
    requests = build_requests(config.serve_dataset, load_tokenizer(setup.model_dir))
    with _server(config, batch) as server:
        serve_config = ServeConfig(
            Target(server.base_url),
            request_rate=config.serve_rate,
            slo=config.serve_slo,
            progress=False,
        )
        return run_serve_benchmark(serve_config, requests)


def _server(config: ReportConfig, max_num_seqs: int) -> LocalServer:
    serve_args = ["--max-num-seqs", str(max_num_seqs), "--dtype", config.dtype]
    serve_args += ["--packed-weight-dtype", config.packed_weight_dtype]
    if config.model is not None:
        serve_args += ["--model", config.model]
    env = None if config.threads is None else {"OMP_NUM_THREADS": str(config.threads)}
    return LocalServer(serve_args, env)
