"""`pagedserve bench report` (what `make bench` runs): every benchmark in one run, one after the
other in one process, kept per kind of host (docs/bench/<kind>/: results.json, plots, REPORT.md),
and BENCHMARKS.md rewritten from every kind's results."""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch

from pagedserve.bench import plots
from pagedserve.bench.ceilings import measure_ceilings, step_bytes, this_machine
from pagedserve.bench.chat_tokens import measure_chat_tokenizing
from pagedserve.bench.client import Target
from pagedserve.bench.datasets import (
    BenchRequest,
    DatasetSpec,
    build_requests,
    load_tokenizer,
    w1_requests,
)
from pagedserve.bench.kquants import run_k_quants
from pagedserve.bench.llama_cpp_peer import (
    gguf_weight_bytes,
    llama_cpp_installed,
    run_llama_cpp,
    run_llama_cpp_batched,
)
from pagedserve.bench.metrics import Slo
from pagedserve.bench.offline import EngineSetup, OfflineRun, run_engine, with_fresh_llm
from pagedserve.bench.prefix_caching import run_prefix_caching_benchmark
from pagedserve.bench.records import (
    Ceilings,
    ChatTokenizing,
    ConstrainedSteps,
    Details,
    HostResults,
    KQuants,
    KvUsage,
    LlamaCpp,
    LongPromptRun,
    Run,
    SeedTimeline,
    ServeRun,
    StepProfile,
    fastest_of_rounds,
)
from pagedserve.bench.render import (
    SEATED_ROWS,
    headline,
    targets,
    write_benchmarks,
    write_host_report,
)
from pagedserve.bench.serve import ServeConfig, run_serve_benchmark
from pagedserve.bench.speed import (
    LongPromptLoad,
    constrained_steps,
    greedy_agreement,
    profile_decode_steps,
    run_long_prompt_load,
)
from pagedserve.bench.sweep import (
    DEFAULT_BATCH_SIZES,
    fixed_requests,
    flat_batch_size,
    largest_meeting,
    run_sweep,
)
from pagedserve.bench.throughput import run_throughput
from pagedserve.bench.timeline import HELD, Segment, run_seed_scenario
from pagedserve.engine.model_runner import resolve_device
from pagedserve.model.source import gguf_file, resolve_model_dir
from pagedserve.server.process import LocalServer

logger = logging.getLogger(__name__)
POLICIES = ("continuous", "static")
# Packed weight dtypes run beside float32 (--packed-weight-dtype): fewer bytes per decode step.
NARROW_WEIGHT_DTYPES = ("bfloat16", "int8", "q4_1", "q4_1_q8", "bfloat16_bf16")
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
    constrained_batches: tuple[int, ...] = (1, 32)
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
    """Runs every benchmark on this host; writes its results, plots and REPORT.md under
    config.plots_dir/<kind>/, then BENCHMARKS.md from every kind's results there."""
    started, load_before = time.monotonic(), os.getloadavg()[0]
    commit = _commit()  # before the run writes its plots into the checkout
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    machine = this_machine()
    host_dir = config.plots_dir / machine.kind
    host_dir.mkdir(parents=True, exist_ok=True)
    stages = _Stages()
    details = _measure(config, host_dir, stages)
    details.minutes = (time.monotonic() - started) / 60
    details.load_average = (load_before, os.getloadavg()[0])
    host = HostResults(
        date=date.today().isoformat(),
        commit=commit,
        machine=machine,
        headline=headline(details),
        targets=targets(details, machine),
        details=details,
    )
    (host_dir / "results.json").write_text(host.model_dump_json(indent=1) + "\n")
    write_host_report(host, config, host_dir / "REPORT.md")
    return write_benchmarks(config.plots_dir, output)


def _commit() -> str:
    """The checkout's commit, when this runs from one."""
    try:
        found = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return found.stdout.strip()


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


def _measure(config: ReportConfig, plots_dir: Path, stages: _Stages) -> Details:
    """Runs every benchmark, drawing the plots of what records do not keep step by step."""
    engine_args, requests = config.engine_args, w1_requests()
    measure = partial(measure_ceilings, resolve_device("auto"))
    first_ceilings = stages.run("ceilings", measure)
    policy_runs = _policy_rounds(config, requests, stages, config.w1_batch_size)
    policies = _fastest_of_each_policy(policy_runs)
    plots.policies_plot(policies, plots_dir / "w1_policies.png")
    plots.kv_usage_plot(policies, plots_dir / "w1_kv_cache.png")
    setup = policies[0].setup
    assert setup is not None
    baseline = stages.run("transformers baseline", partial(_baseline_runs, config))
    sweep = stages.run(
        "sweep",
        partial(
            run_sweep,
            engine_args,
            config.sweep_batch_sizes,
            config.sweep_prompt_len,
            config.sweep_output_len,
        ),
    )
    best = largest_meeting(sweep, config.sweep_slo)
    plots.sweep_plot(sweep, config.sweep_slo, best, plots_dir / "sweep.png")
    flat = flat_batch_size(sweep)
    flat_policies = policies  # already measured when the sweep picks the same size
    if flat != config.w1_batch_size:
        flat_policies = _fastest_of_each_policy(_policy_rounds(config, requests, stages, flat))
    segments = stages.run("seed timeline", partial(_seed_timelines, engine_args))
    plots.timeline_plot(segments, plots_dir / "seed_timeline.png")
    serve = stages.run("bench serve", partial(_serve_run, config, setup))
    seated, http_rounds = _w1_seated_rounds(config, requests, stages)
    single_stream = _single_stream_rounds(config, setup, stages)
    llama_cpp = stages.run("llama.cpp", partial(_llama_cpp_runs, config, requests))
    k_quants = stages.run("GGUF Q4_K_M", partial(_k_quant_runs, config, requests))
    agreement = stages.run("narrow weights agreement", partial(_narrow_weights_agreement, config))
    profiles = stages.run("step profiles", partial(_profile_runs, config))
    constrained = stages.run("structured outputs", partial(_constrained_runs, config))
    chat_tokenizing = stages.run("chat tokenizing", partial(_chat_tokenizing, config))
    long_prompts = stages.run("long prompts", partial(_long_prompt_runs, config))
    prefix = stages.run("prefix caching", partial(run_prefix_caching_benchmark, **engine_args))
    # Measured again last, so that a busy spell at the start cannot set them alone.
    ceilings = Ceilings.best_of([first_ceilings, stages.run("ceilings again", measure)])
    return Details(
        minutes=0.0,
        load_average=(0.0, 0.0),
        stage_seconds=stages.seconds,
        setup=setup.record(),
        ceilings=ceilings,
        policies=[run.summary() for run in policies],
        policy_durations={
            policy: [run.duration_s for run in policy_runs if run.name == policy]
            for policy in POLICIES
        },
        flat_policies=[run.summary() for run in flat_policies],
        kv_usage=[_kv_usage(run) for run in policies],
        baseline=[run.summary() for run in baseline],
        sweep=sweep,
        seed=_seed_timeline(segments),
        serve=serve,
        prefix_caching=prefix,
        seated=seated,
        http_rounds=http_rounds,
        single_stream=single_stream,
        llama_cpp=llama_cpp,
        k_quants=k_quants,
        agreement=agreement,
        profiles=profiles,
        long_prompts=long_prompts,
        constrained=constrained,
        chat_tokenizing=chat_tokenizing,
    )


def _policy_rounds(
    config: ReportConfig, requests: list[BenchRequest], stages: _Stages, seats: int
) -> list[OfflineRun]:
    """W1 under each policy at max_num_seqs seats, config.w1_policy_rounds times, the policies
    taking turns."""
    return [
        stages.run(
            f"W1 {policy} at {seats} seats, round {round_}",
            partial(_w1_run, config, requests, policy, seats),
        )
        for round_ in range(1, config.w1_policy_rounds + 1)
        for policy in POLICIES
    ]


def _fastest_of_each_policy(runs: list[OfflineRun]) -> list[OfflineRun]:
    return [
        min((run for run in runs if run.name == policy), key=lambda run: run.duration_s)
        for policy in POLICIES
    ]


def _kv_usage(run: OfflineRun) -> KvUsage:
    """The most KV cache a W1 run held, paged, and what contiguous reservations for the same
    seats would have held at the same step."""
    assert run.setup is not None
    layout = run.setup.kv_layout
    per_token = layout.bytes_per_token
    return KvUsage(
        name=run.name,
        paged_bytes=max(r.kv_blocks_used for r in run.steps) * layout.block_size * per_token,
        reserved_bytes=max(r.reserved_tokens for r in run.steps) * per_token,
        contiguous_bytes=max(len(r.running) for r in run.steps) * layout.max_model_len * per_token,
    )


def _seed_timeline(segments: dict[str, list[Segment]]) -> SeedTimeline:
    return SeedTimeline(
        c_starts={
            policy: min(s.first_step for s in parts if s.request == "C")
            for policy, parts in segments.items()
        },
        held_steps=sum(
            s.last_step - s.first_step + 1 for s in segments["static"] if s.state == HELD
        ),
    )


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
) -> tuple[dict[str, list[Run]], list[ServeRun]]:
    """W1 with every request seated, round after round: offline for each row of SEATED_ROWS
    (the weights pinned as the report's, a bfloat16 KV cache, each packed format, Q4_1_Q8 with a
    bfloat16 KV cache, Q4_1 with batch invariance off), then over HTTP."""
    variants = {
        "float32": {},
        "bfloat16 KV cache": {"kv_cache_dtype": "bfloat16"},
        "q4_1": {"packed_weight_dtype": "q4_1"},
        "q4_1_q8": {"packed_weight_dtype": "q4_1_q8"},
        "q4_1_q8, bfloat16 KV cache": {
            "packed_weight_dtype": "q4_1_q8",
            "kv_cache_dtype": "bfloat16",
        },
        "bfloat16_bf16": {"packed_weight_dtype": "bfloat16_bf16"},
        "q4_1, not batch-invariant": {"packed_weight_dtype": "q4_1", "batch_invariant": False},
    }
    assert list(variants) == list(SEATED_ROWS)
    seated: dict[str, list[Run]] = {row: [] for row in variants}
    http: list[ServeRun] = []
    offline = partial(_w1_run, config, requests, "continuous", config.w1_all_seated)
    for round_ in range(1, config.w1_seated_rounds + 1):
        for row, variant in variants.items():
            name = "W1 all seated" + (f", {row}" if variant else "")
            run = stages.run(f"{name} {round_}", partial(offline, **variant))
            seated[row].append(run.summary(packed_weight_dtype=variant.get("packed_weight_dtype")))
        http.append(stages.run(f"W1 over HTTP {round_}", partial(_w1_http_run, config, requests)))
    return seated, http


def _w1_http_run(config: ReportConfig, requests: list[BenchRequest]) -> ServeRun:
    """All of W1 streamed at once to a server with every request seated; the summary gains the
    server's peak resident memory."""
    with _server(config, config.w1_all_seated) as server:
        summary = run_serve_benchmark(
            ServeConfig(Target(server.base_url), progress=False), requests
        )
        summary.server_peak_rss_bytes = server.peak_rss_bytes()
    return summary


def _single_stream_rounds(config: ReportConfig, setup: EngineSetup, stages: _Stages) -> list[Run]:
    """The single-stream request through each engine, round after round: each one's fastest
    run, in the order of a round."""
    rounds = [
        stages.run(f"single stream {round_}", partial(_single_stream_round, config, setup))
        for round_ in range(1, config.single_stream_rounds + 1)
    ]
    return [fastest_of_rounds(list(runs)) for runs in zip(*rounds, strict=True)]


def _single_stream_round(config: ReportConfig, setup: EngineSetup) -> list[Run]:
    """One request alone through our engine, through transformers' generate, then through our
    engine with each narrower dtype of packed weights; ours carry the bytes a step reads."""
    requests = fixed_requests(1, *config.single_stream)
    engine_args = {**config.engine_args, "max_num_seqs": 1}
    ours, transformers = run_throughput(engine_args, requests, "transformers")
    work = partial(run_engine, requests=requests)
    narrow = [
        with_fresh_llm(engine_args, work, packed_weight_dtype=dtype).summary(
            name=f"ours, {dtype} packed weights",
            packed_weight_dtype=dtype,
            step_bytes=step_bytes(setup.cost, dtype),
        )
        for dtype in NARROW_WEIGHT_DTYPES
    ]
    ours_run = ours.summary(
        name="ours", step_bytes=step_bytes(setup.cost, setup.packed_weight_dtype)
    )
    return [ours_run, transformers.summary(), *narrow]


def _llama_cpp_runs(config: ReportConfig, requests: list[BenchRequest]) -> LlamaCpp | None:
    """The single-stream request, then all of W1 at once, through llama.cpp on the model's GGUF
    file with as many threads as ours; None when llama-cpp-python is not installed or the model
    is no GGUF file."""
    gguf_path = gguf_file(config.model)
    if gguf_path is None or not llama_cpp_installed():
        return None
    threads, file_bytes = torch.get_num_threads(), gguf_weight_bytes(gguf_path)
    request = fixed_requests(1, *config.single_stream)[0]
    alone = [
        run_llama_cpp(request, gguf_path, threads).summary(step_bytes=file_bytes)
        for _ in range(config.single_stream_rounds)
    ]
    return LlamaCpp(
        gguf=gguf_path.name,
        step_bytes=file_bytes,
        single_stream=fastest_of_rounds(alone),
        w1_all_seated=run_llama_cpp_batched(requests, gguf_path, threads).summary(),
    )


def _k_quant_runs(config: ReportConfig, requests: list[BenchRequest]) -> KQuants | None:
    """The model's GGUF file as Q4_K_M (bench/kquants.py), made in a temporary directory; None
    where _llama_cpp_runs is."""
    gguf_path = gguf_file(config.model)
    if gguf_path is None or not llama_cpp_installed():
        return None
    single = fixed_requests(1, *config.single_stream)[0]
    with tempfile.TemporaryDirectory(prefix="pagedserve-q4_k_m-") as out_dir:
        return run_k_quants(
            config.engine_args,
            gguf_path,
            Path(out_dir),
            single,
            requests,
            config.single_stream_rounds,
        )


def _narrow_weights_agreement(config: ReportConfig):
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


def _chat_tokenizing(config: ReportConfig) -> ChatTokenizing:
    return measure_chat_tokenizing(load_tokenizer(resolve_model_dir(config.model)))


def _constrained_runs(config: ReportConfig) -> list[ConstrainedSteps]:
    """Structured outputs' cost per decode step, on auto's weights (the default path)."""

    def work(llm) -> list[ConstrainedSteps]:
        return [constrained_steps(llm, batch) for batch in config.constrained_batches]

    engine_args = {**config.engine_args, "packed_weight_dtype": "auto"}
    return with_fresh_llm(engine_args, work, max_num_seqs=max(config.constrained_batches))


def _long_prompt_runs(config: ReportConfig) -> list[LongPromptRun]:
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


def _serve_run(config: ReportConfig, setup: EngineSetup) -> ServeRun:
    requests = build_requests(config.serve_dataset, load_tokenizer(setup.model_dir))
    with _server(config, config.w1_batch_size) as server:
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
