"""The "Engine speed targets" section of BENCHMARKS.md: each target beside the figure measured in
the same run, then the runs behind them."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.bench.offline import OfflineRun
from pagedserve.bench.report_sections import Context, fastest, output_ratio, step_count_bound
from pagedserve.bench.speed import STEP_PHASES, StepProfile
from pagedserve.bench.tables import markdown_table


@dataclass
class SpeedFigures:
    # W1 with every request seated, round after round, offline (in process) and through the
    # server, all streamed at once (bench serve summaries with the server's peak RSS).
    all_seated_runs: list[OfflineRun]
    narrow_kv_seated_runs: list[OfflineRun]  # the same offline, with a bfloat16 KV cache
    # and with narrower packed weights, by dtype (--packed-weight-dtype)
    narrow_weight_seated_runs: dict[str, list[OfflineRun]]
    http_runs: list[dict]
    # One request alone: ours, transformers, then ours with each narrower dtype of packed weights
    # (run summaries; those carry their packed_weight_dtype).
    single_stream: list[dict]
    # llama.cpp on the model's GGUF file: its gguf name and step_bytes, and the run summaries of
    # single_stream and w1_all_seated; None when llama-cpp-python is not installed or the model
    # is no GGUF file.
    llama_cpp: dict | None
    # Greedy outputs from float32 against each narrower dtype of packed weights, then against a
    # bfloat16 KV cache (greedy_agreement).
    narrow_weights_agreement: list[dict]
    profiles: list[StepProfile]
    long_prompts: list[dict]  # without, then with chunked prefill
    baseline: list[OfflineRun]  # ours, then transformers at each batch size, W1's first requests
    policies: list[OfflineRun]  # continuous, then static

    @property
    def all_seated(self) -> OfflineRun:
        """The fastest offline round."""
        return _shortest(self.all_seated_runs)

    @property
    def narrow_kv_seated(self) -> OfflineRun:
        """The fastest offline round with a bfloat16 KV cache."""
        return _shortest(self.narrow_kv_seated_runs)

    def narrow_weight_seated(self, dtype: str) -> OfflineRun:
        """The fastest offline round with packed weights of this dtype."""
        return _shortest(self.narrow_weight_seated_runs[dtype])

    @property
    def http(self) -> dict:
        """The fastest round over HTTP."""
        return fastest(self.http_runs)

    @property
    def server_peak_rss_bytes(self) -> int | None:
        """The most any round's server held; None where /proc lacks it."""
        peaks = [run["server_peak_rss_bytes"] for run in self.http_runs]
        return None if None in peaks else max(peaks)

    def as_dict(self) -> dict:
        return {
            "w1_all_seated": self.all_seated.summary(),
            "w1_http": self.http,
            "w1_all_seated_rounds": [run.summary() for run in self.all_seated_runs],
            "w1_all_seated_bfloat16_kv_rounds": [
                run.summary() for run in self.narrow_kv_seated_runs
            ],
            **{
                f"w1_all_seated_{dtype}_rounds": [run.summary() for run in runs]
                for dtype, runs in self.narrow_weight_seated_runs.items()
            },
            "w1_http_rounds": self.http_runs,
            "single_stream": self.single_stream,
            "llama_cpp": self.llama_cpp,
            "narrow_weights_agreement": self.narrow_weights_agreement,
            "step_profiles": [profile.as_dict() for profile in self.profiles],
            "long_prompts": self.long_prompts,
        }


def _shortest(runs: list[OfflineRun]) -> OfflineRun:
    return min(runs, key=lambda run: run.duration_s)


@dataclass
class _Target:
    number: str  # as the issue numbers its targets
    name: str
    goal: str
    measured: str
    met: bool

    def row(self) -> list[object]:
        return [self.number, self.name, self.goal, self.measured, "yes" if self.met else "**no**"]


def speed_targets(context: Context, figures: SpeedFigures, config) -> str:
    targets = _targets(context, figures, config)
    header = ["#", "target", "goal", "measured in this run", "met"]
    rows = [target.row() for target in targets]
    return "\n\n".join(
        [
            "## Engine speed targets",
            "The targets were set for a 2-core CPU with native bfloat16 matrix instructions "
            "(AVX-512 BF16), where bfloat16 products reach 350-400 GFLOP/s and the ideal batched "
            f"rate of this model is near 1,300 tokens/s. This machine has no such instructions: "
            f"it runs {context.dtype} (see the ceilings above), so the absolute goals (tokens/s) "
            "are out of its reach whatever the engine does, and each figure is also given as a "
            "fraction of this machine's own ceiling. Ratios measured side by side in this run "
            "(against transformers, llama.cpp, static batching, offline, without chunking) are "
            "the fair comparison.",
            markdown_table(header, rows),
            _w1_all_seated(context, figures, config),
            _single_stream(context, figures, config),
            _step_profiles(figures.profiles),
            _long_prompts(figures.long_prompts, config),
        ]
    )


def _targets(context: Context, figures: SpeedFigures, config) -> list[_Target]:
    ours_first, *transformers_runs = (run.summary() for run in figures.baseline)
    transformers = fastest(transformers_runs)
    seated = figures.all_seated.summary()
    continuous, static = (run.summary() for run in figures.policies)
    http = figures.http
    hf_ratio = output_ratio(ours_first, transformers)
    of_ideal = seated["total_token_throughput"] / context.ideal(figures.all_seated.batch_size)
    http_ratio = output_ratio(http, seated)
    http_e2e = http["e2e_ms"]["p50"] / 1000
    policy_ratio = output_ratio(continuous, static)
    e2e_ratio = continuous["e2e_ms"]["p50"] / static["e2e_ms"]["p50"]
    best_policy_ratio, best_e2e_ratio = step_count_bound(continuous, static)
    ours_alone, transformers_alone, *narrow_alone = figures.single_stream
    decode_rate = _decode_tokens_per_s(ours_alone)
    bandwidth_bound = _bandwidth_bound(context, ours_alone)
    narrow_rates = ", ".join(
        f"{run['packed_weight_dtype']} {_decode_tokens_per_s(run):.1f} "
        f"({100 * _decode_tokens_per_s(run) / _bandwidth_bound(context, run):.0f}% of its "
        f"{_bandwidth_bound(context, run):.1f} bound)"
        for run in narrow_alone
    )
    best_rate = max(_decode_tokens_per_s(run) for run in [ours_alone, *narrow_alone])
    llama_cpp, llama_cpp_w1 = "not measured", "not measured"
    if figures.llama_cpp is not None:
        llama_cpp = f"{_decode_tokens_per_s(figures.llama_cpp['single_stream']):.1f}"
        llama_cpp_w1 = f"{figures.llama_cpp['w1_all_seated']['output_throughput']:.1f}"
    by_batch = {profile.batch: profile for profile in figures.profiles}
    largest = by_batch[max(by_batch)]
    rss, rss_limit = figures.server_peak_rss_bytes, _rss_limit(context)
    unchunked, chunked = (_itl_spread(run) for run in figures.long_prompts)
    batch, load = config.w1_batch_size, config.long_prompt_load
    return [
        _Target(
            "1",
            f"W1 output tokens/s against transformers' `generate` at its best batch size "
            f"({transformers['batch_size']}; first {ours_first['num_requests']} requests)",
            ">= 3x",
            f"{hf_ratio:.2f}x",
            hf_ratio >= 3,
        ),
        _Target(
            "1",
            f"W1 offline, all {figures.all_seated.batch_size} seated: tokens/s against the "
            "ideal rate",
            ">= 40%",
            f"{100 * of_ideal:.0f}% ({seated['output_throughput']:.1f} output tokens/s; "
            f"llama.cpp {llama_cpp_w1})",
            of_ideal >= 0.4,
        ),
        _Target(
            "2",
            f"W1 over HTTP, {http['num_requests']} streams at once: output tokens/s against "
            "offline",
            ">= 80%",
            f"{100 * http_ratio:.0f}% ({http['output_throughput']:.1f} output tokens/s)",
            http_ratio >= 0.8,
        ),
        _Target("2", "W1 over HTTP: E2E p50", "<= 10 s", f"{http_e2e:.1f} s", http_e2e <= 10),
        _Target(
            "3",
            f"W1 at max_num_seqs {batch}: continuous against static output tokens/s",
            ">= 1.7x",
            f"{policy_ratio:.2f}x (at most {best_policy_ratio:.2f}x on W1: step counts)",
            policy_ratio >= 1.7,
        ),
        _Target(
            "3",
            f"W1 at max_num_seqs {batch}: continuous E2E p50 against static's",
            "<= 1/3",
            f"{e2e_ratio:.2f} (at best {best_e2e_ratio:.2f} on W1: step counts)",
            e2e_ratio <= 1 / 3,
        ),
        _Target(
            "4",
            "single stream ({} + {} tokens): decode tokens/s".format(*config.single_stream),
            ">= 130",
            f"{decode_rate:.1f} ({100 * decode_rate / bandwidth_bound:.0f}% of the "
            f"{bandwidth_bound:.1f} tokens/s bandwidth bound); whole request "
            f"{output_ratio(ours_alone, transformers_alone):.2f}x transformers' `generate`; "
            f"with packed weights of {narrow_rates}; llama.cpp on the GGUF file {llama_cpp}",
            best_rate >= 130,
        ),
        _Target(
            "5",
            f"decode step at batch {largest.batch}: time outside the model forward",
            "<= 10%",
            f"{100 * largest.overhead_share:.1f}% (batch 1: "
            f"{100 * by_batch[min(by_batch)].overhead_share:.1f}%)",
            largest.overhead_share <= 0.10,
        ),
        _Target(
            "6",
            "peak RSS of `pagedserve serve` during W1",
            f"<= weights + KV budget + 1 GiB = {_gib(rss_limit)}",
            "not measured (no /proc)" if rss is None else _gib(rss),
            rss is not None and rss <= rss_limit,
        ),
        _Target(
            "chunked prefill",
            f"ITL p99 / p50 of {load.streams} streams while {load.long_prompt_len:,}-token "
            "prompts arrive, chunked prefill",
            "<= 3x",
            f"{chunked:.1f}x (without chunking: {unchunked:.1f}x)",
            chunked <= 3,
        ),
    ]


def _decode_tokens_per_s(summary: dict) -> float:
    return 1000 / summary["tpot_ms"]["p50"]


def _bandwidth_bound(context: Context, run: dict) -> float:
    """Decode tokens/s of one stream reading each weight once per token, with the linear maps'
    weights as the run packed them, or the bytes the run names (a peer's own weight file)."""
    if "step_bytes" in run:
        return 1e9 * context.ceilings.bandwidth_gbs / run["step_bytes"]
    return context.setup.cost.bandwidth_bound_tokens_per_s(
        context.ceilings, run.get("packed_weight_dtype")
    )


def _rss_limit(context: Context) -> int:
    return context.setup.cost.weight_bytes + context.setup.kv_layout.budget_bytes + 2**30


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _itl_spread(run: dict) -> float:
    itl = run["streams"]["itl_ms"]
    return itl["p99"] / itl["p50"]


def _w1_all_seated(context: Context, figures: SpeedFigures, config) -> str:
    seated, http = figures.all_seated.summary(), figures.http
    layout = context.setup.kv_layout
    header = [
        "W1, 64 requests at once",
        "output tokens/s",
        "TTFT p50 (s)",
        "E2E p50 (s)",
        "E2E p99 (s)",
        "failed",
    ]
    rows = [
        _w1_row(f"offline (`LLM.generate`, max_num_seqs {figures.all_seated.batch_size})", seated),
        _w1_row(
            "offline, bfloat16 KV cache (`--kv-cache-dtype bfloat16`)",
            figures.narrow_kv_seated.summary(),
        ),
        *(
            _w1_row(SEATED_WEIGHT_ROWS[dtype], figures.narrow_weight_seated(dtype).summary())
            for dtype in figures.narrow_weight_seated_runs
        ),
        _w1_row("over HTTP (`bench serve`, streamed)", http, http["failed"]),
    ]
    if figures.llama_cpp is not None:
        batched = figures.llama_cpp["w1_all_seated"]
        name = (
            f"llama.cpp on {figures.llama_cpp['gguf']} ({batched['batch_size']} sequences "
            "batched, as llama-server's slots)"
        )
        rows.append(_w1_row(name, batched))
    rss = figures.server_peak_rss_bytes
    memory = (
        f"The server's peak resident memory (VmHWM) during its runs: {_gib(rss)}, against "
        f"{context.setup.cost.weight_bytes / 2**20:.0f} MiB of weights and a KV budget of "
        f"{layout.num_blocks} blocks of {layout.block_size} tokens "
        f"({_gib(layout.budget_bytes)}), both "
        "printed by the server at start."
    )
    if rss is None:
        memory = "This system has no /proc, so the server's peak memory was not read."
    seats, flag = config.w1_all_seated, context.weights_flag
    return "\n\n".join(
        part
        for part in [
            "### W1 with every request seated: offline and over HTTP",
            f"All of W1 at once, with `max_num_seqs {seats}`, first through `LLM.generate` in "
            "this process, then streamed to a `pagedserve serve` process by `bench serve` (its "
            "client runs on the same 2 cores), then, as a peer, through llama.cpp in this "
            "process with as many threads: each request is its own sequence of one llama.cpp "
            "context, and each step is one `llama_decode` over every sequence's next token, "
            "whole prompts filling the rest of a 2,048-token batch, as llama-server runs its "
            "`--parallel` slots. llama.cpp's rows are greedy argmax over its logits, timed as "
            "ours are.",
            "```sh\n"
            f"pagedserve bench throughput --dataset w1 --max-num-seqs {seats}{flag}\n"
            f"pagedserve serve --max-num-seqs {seats}{flag} &\n"
            "pagedserve bench serve --dataset w1\n```",
            markdown_table(header, rows),
            _seated_rounds_note(figures),
            memory,
        ]
        if part
    )


def _seated_rounds_note(figures: SpeedFigures) -> str:
    rounds = len(figures.http_runs)
    if rounds == 1:
        return ""
    offline, narrow_kv = (
        _rates([run.summary()["output_throughput"] for run in runs])
        for runs in (figures.all_seated_runs, figures.narrow_kv_seated_runs)
    )
    narrow_weights = "".join(
        f"with {dtype} weights {_rates([run.summary()['output_throughput'] for run in runs])}; "
        for dtype, runs in figures.narrow_weight_seated_runs.items()
    )
    http = _rates([run["output_throughput"] for run in figures.http_runs])
    return (
        f"Each row ran W1 {rounds} times, taking turns, and the table shows each one's fastest "
        "run, so that a busy spell on the shared machine does not decide target 2's ratio. "
        f"Output tokens/s in the order run: offline {offline}; with a bfloat16 KV cache "
        f"{narrow_kv}; {narrow_weights}over HTTP {http}. The bfloat16 cache "
        "stores each key and value rounded once and holds twice the tokens in the same memory; "
        "attention still computes in float32. q4_1 holds the weights llama.cpp's row reads "
        "(the GGUF's Q4_1 linear maps and Q8_0 logits) exactly, in float32 arithmetic; q4_1_q8 "
        "holds the same and computes its linear maps as llama.cpp does, each input rounded to 8 "
        "bits per group of 32 and the products summed in integers; its logits stay float32 "
        "arithmetic."
    )


# The W1 rows of narrower packed weights, by dtype: W1 with every request seated runs each of
# them (q4_1 is what auto packs the default model as).
SEATED_WEIGHT_ROWS = {
    "q4_1": "offline, the GGUF's Q4_1 weights (`--packed-weight-dtype q4_1`, auto's pick for them)",
    "q4_1_q8": "offline, llama.cpp's Q4_1 weights and arithmetic (`--packed-weight-dtype q4_1_q8`)",
}


def _w1_row(name: str, summary: dict, failed: int = 0) -> list[object]:
    """A W1 run's row: output tokens/s, TTFT p50, E2E p50 and p99 (s), failed requests."""
    ttft, e2e = summary["ttft_ms"], summary["e2e_ms"]
    latencies = [ttft["p50"] / 1000, e2e["p50"] / 1000, e2e["p99"] / 1000]
    return [name, summary["output_throughput"], *latencies, failed]


def _single_stream(context: Context, figures: SpeedFigures, config) -> str:
    ours, transformers, *narrow = figures.single_stream
    prompt_len, output_len = config.single_stream
    rate, bound = _decode_tokens_per_s(ours), _bandwidth_bound(context, ours)
    peers = [] if figures.llama_cpp is None else [_llama_cpp_single_stream(figures.llama_cpp)]
    header = [
        "one request alone",
        "output tokens/s, whole request",
        "E2E (s)",
        "decode tokens/s",
        "share of its bandwidth bound",
    ]
    rows = [
        [
            run["name"],
            run["output_throughput"],
            run["e2e_ms"]["p50"] / 1000,
            _decode_tokens_per_s(run) if run["tpot_ms"] else "",
            f"{100 * _decode_tokens_per_s(run) / _bandwidth_bound(context, run):.0f}%"
            if run["tpot_ms"]
            else "",
        ]
        for run in (ours, transformers, *narrow, *peers)
    ]
    agreements = "; ".join(
        f"{_variant_name(agreement['variant'])}: {agreement['identical']} of "
        f"{agreement['requests']} identical, {100 * agreement['mean_share_before_divergence']:.0f}%"
        for agreement in figures.narrow_weights_agreement
    )
    first = figures.narrow_weights_agreement[0]
    return "\n\n".join(
        [
            "### Single stream",
            f"One request of {prompt_len} prompt and {output_len} output tokens, alone "
            f"(`max_num_seqs 1`). TTFT {ours['ttft_ms']['p50']:.0f} ms; TPOT "
            f"{ours['tpot_ms']['p50']:.1f} ms, that is **{rate:.1f} decode tokens/s**, "
            f"{100 * rate / bound:.0f}% of the bandwidth-bound ceiling of {bound:.1f} tokens/s "
            f"({context.setup.cost.weight_bytes / 2**20:.0f} MiB of weights read per step at the "
            f"measured {context.ceilings.bandwidth_gbs:.1f} GB/s). The same request through "
            "transformers' `generate` in the same run, timed whole (prompt included), beside "
            "ours timed the same way, and ours with the linear weights packed narrower "
            "(`--packed-weight-dtype`; float32 arithmetic but for q4_1_q8): bfloat16 rounds the "
            "weights and halves the bytes per step, int8 quantizes each output feature with its "
            "own scale and quarters them, q4_1 stores llama.cpp's Q4_1 (5 bits a weight) with the "
            "logits' weights in Q8_0 (8.5 bits), and q4_1_q8 stores the same and computes the "
            "Q4_1 maps as llama.cpp does, in integers against inputs rounded to 8 bits. Each "
            "run's bandwidth bound counts the bytes it reads:",
            markdown_table(header, rows),
            _rounds_note(config.single_stream_rounds, [ours, transformers, *narrow, *peers]),
            _llama_cpp_note(figures.llama_cpp),
            "What narrower weights, and a narrower KV cache, cost in accuracy: greedy outputs of "
            "W1's first "
            f"{first['requests']} requests (at most {config.agreement_output_len} tokens each, "
            f"{first['output_tokens']} in all) from float32 against each, with the number of "
            "identical outputs and the share of an output, on average, that comes before its "
            f"first differing token. {agreements}. (bfloat16 keeps 8 bits of mantissa; int8 "
            "rounds each weight to a step of 1/127 of its row's largest magnitude. The default "
            "model's GGUF stores its linear maps as Q4_1 and its embeddings as Q8_0, dequantized "
            "to float32 on loading: q4_1 holds those weights exactly, so it differs from float32 "
            "only in the order of its sums; q4_1_q8 also rounds each linear map's inputs to a "
            "step of 1/127 of their group's largest magnitude.)",
        ]
    )


def _rounds_note(rounds: int, runs: list[dict]) -> str:
    rates = "; ".join(f"{run['name']} {_rates(run['round_output_throughputs'])}" for run in runs)
    return (
        f"Each ran the request {rounds} times (ours and transformers taking turns, llama.cpp in "
        "its own stage), and the table shows each one's fastest run. Output tokens/s of every "
        f"run, whole request, in the order run: {rates}."
    )


def _rates(values: list[float]) -> str:
    """Tokens/s figures, in the order given, as the notes list them."""
    return ", ".join(f"{value:.1f}" for value in values)


def _variant_name(variant: dict) -> str:
    """An agreement variant as the accuracy note names it: a packed dtype, or the KV cache's."""
    if "kv_cache_dtype" in variant:
        return f"{variant['kv_cache_dtype']} KV cache"
    return variant["packed_weight_dtype"]


def _llama_cpp_single_stream(llama_cpp: dict) -> dict:
    """Its single-stream summary, with the bytes its bandwidth bound counts."""
    return llama_cpp["single_stream"] | {"step_bytes": llama_cpp["step_bytes"]}


def _llama_cpp_note(llama_cpp: dict | None) -> str:
    if llama_cpp is None:
        return (
            "llama.cpp was not measured in this run: llama-cpp-python is not installed (`make "
            "bench` installs it), or the model is no GGUF file."
        )
    return (
        f"llama.cpp ran the GGUF file itself ({llama_cpp['gguf']}) through llama-cpp-python, in "
        "this process with as many threads as ours, greedy, timed as ours is: its bound counts "
        f"the file's {llama_cpp['step_bytes'] / 2**20:.0f} MiB of tensors read per step. Its "
        "weights stay as the file stores them (4-bit for the default model), and its products "
        "of quantized weights round the activations to 8 bits."
    )


def _step_profiles(profiles: list[StepProfile]) -> str:
    header = ["phase"]
    for profile in profiles:
        header += [f"batch {profile.batch} (ms)", "share"]
    rows = []
    for phase in STEP_PHASES:
        row: list[object] = [phase]
        for profile in profiles:
            total = sum(profile.phase_ms.values())
            row += [profile.phase_ms[phase], f"{100 * profile.phase_ms[phase] / total:.1f}%"]
        rows.append(row)
    totals: list[object] = ["whole step (wall clock)"]
    for profile in profiles:
        totals += [profile.step_ms, ""]
    rows.append(totals)
    op_tables = [_op_table(profile) for profile in profiles]
    context_len = profiles[0].context_len
    return "\n\n".join(
        [
            "### Where a decode step's time goes",
            "Decode steps after a prompt of "
            f"{context_len - 1} tokens per sequence, timed by the engine's own synchronized "
            "phase timers (`engine.phase_timer`, exported as "
            "`pagedserve:step_phase_seconds_total{phase}`): `schedule` picks the batch, `prepare` "
            "builds the input tensors, `forward` is the model, `sample` the sampler, `output` "
            "appends tokens, detokenizes and checks stop conditions.",
            markdown_table(header, rows),
            "The same steps again under `torch.profiler`, the operators with the most self "
            "time (the profiler's own overhead makes these steps slower; see the last row):",
            *op_tables,
        ]
    )


def _op_table(profile: StepProfile) -> str:
    rows: list[list[object]] = [
        [name, ms, f"{100 * ms / profile.profiled_step_ms:.1f}%"] for name, ms in profile.top_ops_ms
    ]
    rows.append(["whole step under the profiler", profile.profiled_step_ms, "100%"])
    header = [f"operator, batch {profile.batch}", "ms per step", "share"]
    return markdown_table(header, rows)


def _long_prompts(runs: list[dict], config) -> str:
    load = config.long_prompt_load
    header = [
        "run",
        "max_num_batched_tokens",
        "stream ITL p50 (ms)",
        "p90 (ms)",
        "p99 (ms)",
        "p99 / p50",
        "long prompts' TTFT p50 (s)",
        "stream output tokens/s",
    ]
    rows = []
    for run in runs:
        itl, streams = run["streams"]["itl_ms"], run["streams"]
        name = "chunked prefill" if run["chunked_prefill"] else "no chunking"
        rows.append(
            [
                name,
                run["max_num_batched_tokens"],
                itl["p50"],
                itl["p90"],
                itl["p99"],
                f"{itl['p99'] / itl['p50']:.1f}x",
                run["long_prompts"]["ttft_ms"]["p50"] / 1000,
                streams["output_throughput"],
            ]
        )
    arrivals = ", ".join(f"{t:g}" for t in load.long_arrivals_s)
    return "\n\n".join(
        [
            "### Long prompts arriving: chunked prefill",
            f"{load.streams} streams ({load.stream_prompt_len} prompt, {load.stream_output_len} "
            f"output tokens) decode while {len(load.long_arrivals_s)} prompts of "
            f"{load.long_prompt_len:,} tokens arrive at {arrivals} s. The engine is driven as "
            "the server's engine thread drives it (arrivals join before the next step) and each "
            "token is timed when its step returns. Without chunking a long prompt is computed "
            "in one step and every stream waits for it; with chunking each step takes the "
            "decodes first, then at most the rest of its token budget "
            f"(`max_num_batched_tokens {config.chunked_budget}`, well below the default 2,048, "
            "so that a step with a prompt chunk costs a few decode steps on this CPU) from the "
            "prompt. The price is the long prompts' own TTFT.",
            markdown_table(header, rows),
        ]
    )
