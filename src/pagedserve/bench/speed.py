"""In-process speed measurements behind the engine's speed targets: where a decode step's time
goes at a given batch size, what structured outputs add to it, and the inter-token latency of
running streams while long prompts arrive (with and without chunked prefill)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile

from pagedserve.bench.datasets import BenchRequest
from pagedserve.bench.metrics import RequestResult, summarize
from pagedserve.bench.offline import greedy_params, warm_up, with_fresh_llm
from pagedserve.bench.records import (
    STEP_PHASES,
    Agreement,
    ConstrainedSteps,
    LongPromptRun,
    StepProfile,
)
from pagedserve.bench.sweep import fixed_requests
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.llm import LLM
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

# Held to it, a row goes on through every timed step: 400 letters or spaces, then the end.
STEP_CONSTRAINT = StructuredOutputsParams(regex="[a-z ]{400}")


def profile_decode_steps(
    llm: LLM, batch: int, prompt_len: int = 32, steps: int = 8, top: int = 8
) -> StepProfile:
    """Seats `batch` requests, computes their prompts, then times `steps` decode steps with the
    phase timers and `steps` more under torch.profiler."""
    warm_up(llm)
    engine = llm.engine
    # Prompts beyond one step's token budget take several steps, and the first ones computed
    # decode meanwhile: their outputs are long enough to last through every timed step.
    prompt_steps = -(-batch * prompt_len // engine.config.max_num_batched_tokens) + 1
    requests = fixed_requests(batch, prompt_len, output_len=2 * steps + 2 + prompt_steps)
    _submit(engine, requests)
    while engine.scheduler.waiting or _prefilling(engine):
        engine.step()
    timer = engine.phase_timer
    before = dict(timer.seconds)
    step_ms, fewest_timed = _timed_steps(engine, steps)
    phase_ms = {
        phase: 1000 * (timer.seconds.get(phase, 0.0) - before.get(phase, 0.0)) / steps
        for phase in STEP_PHASES
    }
    with profile(activities=_profiler_activities(engine)) as profiler:
        profiled_step_ms, fewest_profiled = _timed_steps(engine, steps)
    while engine.has_unfinished_requests():
        engine.step()
    return StepProfile(
        batch=batch,
        context_len=prompt_len + 1,
        step_ms=step_ms,
        phase_ms=phase_ms,
        top_ops_ms=_top_ops(profiler, engine, steps, top),
        profiled_step_ms=profiled_step_ms,
        fewest_running=min(fewest_timed, fewest_profiled),
    )


def constrained_steps(
    llm: LLM, batch: int, prompt_len: int = 32, steps: int = 16
) -> ConstrainedSteps:
    """Decode steps of `batch` sequences, timed by the phase timers as profile_decode_steps
    times them: first with no row constrained, then the same requests with every row held to
    STEP_CONSTRAINT (masks filled in `sample`, matchers fed in `output`)."""
    warm_up(llm)
    engine, timer = llm.engine, llm.engine.phase_timer
    prompt_steps = -(-batch * prompt_len // engine.config.max_num_batched_tokens) + 1
    timed: list[tuple[float, dict[str, float]]] = []
    for constraint in (None, STEP_CONSTRAINT):
        params = SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=steps + prompt_steps + 2,
            structured_outputs=constraint,
        )  # fmt: skip
        for request in fixed_requests(batch, prompt_len, output_len=1):
            engine.add_request(request.engine_prompt, params)
        while engine.scheduler.waiting or _prefilling(engine):
            engine.step()
        before = dict(timer.seconds)
        step_ms, _ = _timed_steps(engine, steps)
        phase_ms = {
            phase: 1000 * (timer.seconds.get(phase, 0.0) - before.get(phase, 0.0)) / steps
            for phase in STEP_PHASES
        }
        timed.append((step_ms, phase_ms))
        while engine.has_unfinished_requests():
            engine.step()
    (free_ms, free_phases), (held_ms, held_phases) = timed
    return ConstrainedSteps(
        batch=batch,
        constraint=STEP_CONSTRAINT.regex,
        step_ms=free_ms,
        constrained_step_ms=held_ms,
        phase_ms=free_phases,
        constrained_phase_ms=held_phases,
    )


def _timed_steps(engine: LLMEngine, steps: int) -> tuple[float, int]:
    """Runs `steps` engine steps: the mean wall time of one (ms), and the fewest sequences that
    any of them ran."""
    fewest_running = len(engine.scheduler.running)
    started = time.perf_counter()
    for _ in range(steps):
        fewest_running = min(fewest_running, len(engine.scheduler.running))
        engine.step()
    return 1000 * (time.perf_counter() - started) / steps, fewest_running


def _prefilling(engine: LLMEngine) -> bool:
    return any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running)


def _submit(engine: LLMEngine, requests: list[BenchRequest]) -> list[str]:
    return [
        engine.add_request(r.engine_prompt, params)
        for r, params in zip(requests, greedy_params(requests), strict=True)
    ]


def _profiler_activities(engine: LLMEngine) -> list[ProfilerActivity]:
    if engine.runner.device.type == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    return [ProfilerActivity.CPU]


def _top_ops(profiler, engine: LLMEngine, steps: int, top: int) -> list[tuple[str, float]]:
    """The operators with the most self time, in ms per step (device time on a GPU)."""
    on_gpu = engine.runner.device.type == "cuda"
    events = profiler.key_averages()

    def self_us(event) -> float:
        return event.self_device_time_total if on_gpu else event.self_cpu_time_total

    ranked = sorted(events, key=self_us, reverse=True)
    return [(event.key, self_us(event) / 1000 / steps) for event in ranked[:top]]


@dataclass
class LongPromptLoad:
    """Streams decoding while long prompts arrive: the load that chunked prefill is for."""

    streams: int = 32
    stream_prompt_len: int = 32
    stream_output_len: int = 128
    long_prompt_len: int = 2000
    long_output_len: int = 8
    long_arrivals_s: tuple[float, ...] = (2.0, 7.0, 12.0)


def run_long_prompt_load(llm: LLM, load: LongPromptLoad) -> LongPromptRun:
    """Drives the engine as the server's engine thread does (arrivals are added before each
    step) and times every token as the step that produced it returns."""
    warm_up(llm)
    engine = llm.engine
    streams = fixed_requests(load.streams, load.stream_prompt_len, load.stream_output_len)
    arrivals = list(
        zip(
            load.long_arrivals_s,
            fixed_requests(
                len(load.long_arrivals_s), load.long_prompt_len, load.long_output_len, seed=1
            ),
            strict=True,
        )
    )
    results: dict[str, RequestResult] = {}
    started = time.perf_counter()
    stream_ids = _submit_timed(engine, streams, results)
    long_ids: list[str] = []
    while arrivals or engine.has_unfinished_requests():
        now = time.perf_counter()
        while arrivals and started + arrivals[0][0] <= now:
            long_ids += _submit_timed(engine, [arrivals.pop(0)[1]], results)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, started + arrivals[0][0] - now))
            continue
        outputs = engine.step()
        done_at = time.perf_counter()
        for output in outputs:
            result = results[output.request_id]
            if output.new_token_ids:
                result.token_times.append(done_at)
            if output.final is not None:
                result.end = done_at
                result.output_tokens = len(output.final.outputs[0].token_ids)
    duration = time.perf_counter() - started
    return LongPromptRun(
        streams=summarize([results[i] for i in stream_ids], duration),
        long_prompts=summarize([results[i] for i in long_ids], duration),
        chunked_prefill=engine.config.enable_chunked_prefill,
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
    )


def _submit_timed(
    engine: LLMEngine, requests: list[BenchRequest], results: dict[str, RequestResult]
) -> list[str]:
    now = time.perf_counter()
    ids = _submit(engine, requests)
    for request_id, request in zip(ids, requests, strict=True):
        results[request_id] = RequestResult(start=now, prompt_tokens=request.prompt_len)
    return ids


def greedy_agreement(
    engine_args: dict, requests: list[BenchRequest], variants: list[dict[str, str]]
) -> list[Agreement]:
    """Greedy outputs of the engine as configured, then with each variant's settings, compared
    request by request: how many are identical, and the mean share of an output that comes
    before its first differing token. One result per variant."""

    def outputs(llm: LLM) -> list[list[int]]:
        prompts = [r.engine_prompt for r in requests]
        return [out.outputs[0].token_ids for out in llm.generate(prompts, greedy_params(requests))]

    reference = with_fresh_llm(engine_args, outputs)
    results = []
    for variant in variants:
        pairs = list(zip(reference, with_fresh_llm(engine_args, outputs, **variant), strict=True))
        shares = [_common_prefix_len(ours, theirs) / len(ours) for ours, theirs in pairs]
        results.append(
            Agreement(
                variant=variant,
                requests=len(requests),
                output_tokens=sum(len(tokens) for tokens in reference),
                identical=sum(ours == theirs for ours, theirs in pairs),
                mean_share_before_divergence=sum(shares) / len(shares),
            )
        )
    return results


def _common_prefix_len(first: list[int], second: list[int]) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b),
        min(len(first), len(second)),
    )
