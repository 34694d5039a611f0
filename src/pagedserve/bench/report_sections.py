"""The sections of BENCHMARKS.md, each from figures already measured (nothing is run here but
the prefix-caching benchmark, which another module owns)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from pathlib import Path

from pagedserve.bench import plots
from pagedserve.bench.ceilings import Ceilings, machine_description
from pagedserve.bench.metrics import QUANTILES
from pagedserve.bench.offline import EngineSetup, OfflineRun
from pagedserve.bench.prefix_caching import format_markdown, run_prefix_caching_benchmark
from pagedserve.bench.sweep import largest_meeting
from pagedserve.bench.tables import markdown_table, serve_table, sweep_table
from pagedserve.bench.timeline import HELD, Segment


@dataclass
class Context:
    plots_dir: Path  # where the PNGs are written
    plots_link: Path  # the same folder as BENCHMARKS.md links to it
    ceilings: Ceilings
    setup: EngineSetup

    @property
    def dtype(self) -> str:
        return str(self.setup.dtype).removeprefix("torch.")

    @property
    def weights_flag(self) -> str:
        """The flag that pins the runs' packed weights, for the commands shown beside them."""
        dtype = self.setup.packed_weight_dtype
        return "" if dtype is None else f" --packed-weight-dtype {dtype}"

    def ideal(self, batch: int) -> float:
        """Tokens/s (prompt and output alike) the hardware allows at this batch size."""
        return self.setup.cost.ideal_tokens_per_s(self.ceilings, self.dtype, batch)

    def image(self, name: str, caption: str) -> str:
        return f"![{caption}]({(self.plots_link / name).as_posix()})\n"


def _code(*commands: str) -> str:
    return "```sh\n" + "\n".join(commands) + "\n```\n"


def header(
    day: date, minutes: float, loads: tuple[float, float], stage_seconds: dict[str, float]
) -> str:
    stages = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in stage_seconds.items())
    return f"""# Benchmarks

Measured on {day.isoformat()} by `make bench` (`pagedserve bench report`), which regenerates this
file, the plots in `docs/bench/` and the raw figures in `docs/bench/results.json` in one run; this
run took {minutes:.1f} minutes ({stages}). The machine is shared with other developers' tests and
benchmarks: its 1-minute load average was {loads[0]:.1f} at the start and {loads[1]:.1f} at the
end, on {machine_description()["cores"]} cores. Absolute figures therefore move by tens of percent
from one run to the next; the ratios between runs made side by side in this one run are the
figures to trust.

Every timing of model work reads a monotonic clock after the device has finished its queued work
(`pagedserve.timing`: `torch.cuda.synchronize` on CUDA; CPU work is synchronous), and each run
starts after a warm-up request that no figure includes. Per-request times inside the engine are
taken after the sampled tokens have been copied to the host, which waits for the device too.
"""


def machine_facts(context: Context) -> dict:
    layout = context.setup.kv_layout
    return {
        **machine_description(),
        "model": context.setup.model_dir.name,
        "dtype": context.dtype,
        "device": str(context.setup.device),
        "packed_weight_dtype": context.setup.packed_weight_dtype or "none (F.linear)",
        "kv_cache": f"{layout.num_blocks} blocks of {layout.block_size} tokens",
    }


def machine(context: Context) -> str:
    facts = machine_facts(context)
    rows = [
        ["CPU", facts["cpu"]],
        ["cores / torch threads", f"{facts['cores']} / {facts['torch_threads']}"],
        ["GPU", facts["cuda"] or "none"],
        [
            "native bfloat16 matmul (AVX-512 BF16 / AMX)",
            "yes" if facts["native_bfloat16"] else "no",
        ],
        ["torch / Python", f"{facts['torch']} / {facts['python']}"],
        ["model", facts["model"]],
        ["dtype (`--dtype auto`) / device", f"{facts['dtype']} / {facts['device']}"],
        [
            "packed linear weights (`auto`, the default, keeps a Q4_1 GGUF's own as q4_1; "
            "the rows below set float32 unless they say otherwise)",
            facts["packed_weight_dtype"],
        ],
        ["KV cache (default `--kv-cache-memory 1GiB`)", facts["kv_cache"]],
    ]
    return "## Machine\n\n" + markdown_table(["", ""], rows) + "\n"


def ceilings(context: Context, batch: int) -> str:
    c, cost = context.ceilings, context.setup.cost
    flops = c.matmul_gflops
    compute = cost.compute_bound_tokens_per_s(c, context.dtype)
    memory = cost.bandwidth_bound_tokens_per_s(c)
    rows = [
        [
            "matmul, float32 (1024 x 1024; the faster of torch.mm and the engine's packed product)",
            f"{flops['float32']:.1f} GFLOP/s",
        ],
        ["matmul, bfloat16 (1024 x 1024)", f"{flops['bfloat16']:.1f} GFLOP/s"],
        ["memory read bandwidth (256 MiB buffer)", f"{c.bandwidth_gbs:.1f} GB/s"],
        [f"model weights ({context.dtype})", f"{cost.weight_bytes / 2**20:.0f} MiB"],
        [
            "model work per token (2 FLOPs per multiplied weight)",
            f"{cost.flops_per_token / 1e9:.2f} GFLOP",
        ],
        ["ideal tokens/s, compute bound (any batch)", f"{compute:.0f}"],
        ["ideal tokens/s, bandwidth bound at batch 1 (weights read per step)", f"{memory:.1f}"],
        [
            f"ideal tokens/s at batch {batch} (the smaller of the two bounds)",
            f"{context.ideal(batch):.0f}",
        ],
    ]
    return f"""## The machine's ceilings

Measured in the same run, best of several repeats{_measured_twice(c)}. A decode step reads every
weight once and multiplies each by every token of the batch, so tokens/s can exceed neither
`FLOP/s / FLOPs per token` nor `batch x bandwidth / weight bytes`; attention over the context is
left out (a few percent of the work at these lengths). Every throughput below is also given as a
fraction of the ideal at its batch size, prompt and output tokens alike.

{markdown_table(["", ""], rows)}

{_dtype_note(context, flops)}

{_threads_note(c)}
"""


def _measured_twice(c: Ceilings) -> str:
    """How the rates came from several measurements, when they did."""
    if len(c.measurements) < 2:
        return ""
    flops = " then ".join(f"{m['matmul_gflops']['float32']:.1f}" for m in c.measurements)
    bandwidth = " then ".join(f"{m['bandwidth_gbs']:.1f}" for m in c.measurements)
    return (
        ", at the start of the run and again at its end, and the higher of the two counts "
        f"(float32 matmul {flops} GFLOP/s; read bandwidth {bandwidth} GB/s)"
    )


def _dtype_note(context: Context, flops: dict[str, float]) -> str:
    kernels = (
        f"`--dtype auto` chose {context.dtype}: on a CPU where the C++ kernels build it keeps "
        "them, in float32 arithmetic over the checkpoint's own packed weights"
    )
    if machine_description()["native_bfloat16"]:
        return f"{kernels}; this CPU multiplies bfloat16 natively (torch's path without kernels)."
    slower = flops["float32"] / flops["bfloat16"]
    return (
        f"{kernels}; this CPU has no native bfloat16 matrix instructions (AVX-512 BF16 / AMX), "
        f"so bfloat16 products are emulated: the square matmul above runs {slower:.1f}x slower "
        "in bfloat16 than in float32."
    )


def _threads_note(c: Ceilings) -> str:
    note = (
        f"This run uses {c.threads} torch thread(s); `make bench` uses one unless told "
        "`BENCH_THREADS=2`. On this shared machine a parallel operation waits for whichever of "
        "its threads the OS has set aside for another process: while other developers' tests "
        "ran, a decode step of SmolLM2 at batch 32 was seen taking 3.6 times longer on two threads "
        "than on one (and 17 times longer for a tiny test model, whose steps are all small "
        "operations)."
    )
    if len(c.small_product_us) < 2:
        return note
    times = ", ".join(f"{us:.0f} us on {n}" for n, us in c.small_product_us.items())
    return (
        f"{note} At the start of this run a decode-sized product ([8, 576] x [576, 1536]) took "
        f"on average {times} thread(s)."
    )


def _fraction(context: Context, total_throughput: float, batch: int) -> str:
    return f"{100 * total_throughput / context.ideal(batch):.0f}%"


def _offline_rows(context: Context, runs: list[OfflineRun]) -> str:
    header = [
        "run",
        "max_num_seqs",
        "output tokens/s",
        "total tokens/s",
        "of ideal",
        "E2E p50 (s)",
        "E2E p90 (s)",
        "E2E p99 (s)",
        "duration (s)",
    ]
    rows = []
    for run in runs:
        s = run.summary()
        e2e = s["e2e_ms"]
        rows.append(
            [
                s["name"],
                s["batch_size"],
                s["output_throughput"],
                s["total_token_throughput"],
                _fraction(context, s["total_token_throughput"], s["batch_size"]),
                e2e["p50"] / 1000,
                e2e["p90"] / 1000,
                e2e["p99"] / 1000,
                s["duration_s"],
            ]
        )
    return markdown_table(header, rows)


def w1_policies(context: Context, runs: list[OfflineRun], durations: dict[str, list[float]]) -> str:
    """runs: each policy's fastest run; durations: every run's, by policy, in the order run."""
    batch = runs[0].batch_size
    ours, static = (run.summary() for run in runs)
    command = (
        f"pagedserve bench throughput --dataset w1 --max-num-seqs {batch}{context.weights_flag}"
    )
    plots.policies_plot(runs, context.plots_dir / "w1_policies.png")
    return _join(
        "## Continuous against static batching on W1",
        "W1 is the fixed workload: `rng = numpy.random.default_rng(0)`; `prompt_lens = "
        "rng.integers(8, 129, 64)`; `output_lens = rng.integers(8, 257, 64)`; then each "
        "request's prompt `rng.integers(1000, 40000, prompt_lens[i])`: 64 requests, 4,429 "
        "prompt and 8,632 output tokens, greedy, end-of-sequence ignored, all arriving at once "
        "(so E2E includes the wait for a seat). "
        f"`max_num_seqs` is {batch}, below the 64 requests, so that requests wait for seats and "
        "the policies differ. `static` is our engine with request-level batching: a batch "
        "forms, nobody joins it until all its members are done, and their results are handed "
        "back together.",
        _code(f"{command} --scheduler continuous", f"{command} --scheduler static"),
        _rounds_note(durations),
        _offline_rows(context, runs),
        f"Continuous batching gives **{_ratio(ours, static)}** the output tokens/s of static "
        f"batching. E2E p50: {_e2e(ours, 'p50')} against {_e2e(static, 'p50')}; p99: "
        f"{_e2e(ours, 'p99')} against {_e2e(static, 'p99')}.",
        context.image("w1_policies.png", "Throughput and E2E latency distribution on W1"),
        "Where the time went, from the step trace: a prefill step is one in which some "
        "request's prompt was computed (under continuous batching, alongside the others' "
        "decodes); a decode step computes one token per seated request.",
        _steps_table([ours, static]),
        _step_count_note(ours, static, batch),
    )


def _rounds_note(durations: dict[str, list[float]]) -> str:
    rounds = len(next(iter(durations.values())))
    if rounds == 1:
        return ""
    took = "; ".join(
        f"{policy} {', '.join(f'{seconds:.1f}' for seconds in times)} s"
        for policy, times in durations.items()
    )
    return (
        f"Each policy ran W1 {rounds} times, the policies taking turns, and the tables show "
        f"each one's fastest run, so that a busy spell on the shared machine does not decide "
        f"the comparison. Durations in the order run: {took}."
    )


def step_count_bound(ours: dict, static: dict) -> tuple[float, float]:
    """Continuous batching's gain over static batching as it would be if every step cost the
    same whatever it held: static's step count over ours, and our median request's release step
    over static's (E2E p50 counted in steps)."""
    ours_steps, static_steps = ours["steps"], static["steps"]
    return (
        static_steps["steps"] / ours_steps["steps"],
        ours_steps["release_step_p50"] / static_steps["release_step_p50"],
    )


def _step_count_note(ours: dict, static: dict, batch: int) -> str:
    throughput, e2e = step_count_bound(ours, static)
    return (
        f"Counted in steps instead of seconds, continuous batching ran W1 in "
        f"{ours['steps']['steps']} steps against static's {static['steps']['steps']}, and handed "
        f"back its median request after {ours['steps']['release_step_p50']:g} steps against "
        f"{static['steps']['release_step_p50']:g}. If every step cost the same whatever it held "
        "(decode bound by memory bandwidth: the case most favourable to continuous batching), it "
        f"would give **{throughput:.2f}x** static's output tokens/s and **{e2e:.2f}** of its E2E "
        f"p50: the step counts bound the gain on W1 at max_num_seqs {batch} wherever steps cost "
        "about the same. On this CPU a step costs more as it fills (the mean decode steps "
        "above), so the measured gain is smaller."
    )


def _steps_table(summaries: list[dict]) -> str:
    header = [
        "run",
        "steps",
        "prefill steps",
        "mean prefill step (s)",
        "decode steps",
        "mean decode step (s)",
        "time in prefill steps (s)",
    ]
    rows = []
    for s in summaries:
        steps = s["steps"]
        rows.append(
            [
                s["name"],
                steps["steps"],
                steps["prefill_steps"],
                steps["prefill_step_mean_s"],
                steps["decode_steps"],
                steps["decode_step_mean_s"],
                steps["seconds_in_prefill_steps"],
            ]
        )
    return markdown_table(header, rows)


def transformers_baseline(context: Context, runs: list[OfflineRun]) -> str:
    ours, *theirs = (run.summary() for run in runs)
    best = fastest(theirs)
    count = ours["num_requests"]
    sizes = [str(run["batch_size"]) for run in theirs]
    return _join(
        "## Against transformers' `generate`",
        "transformers' `generate` with request-level batching takes about ten minutes for all "
        f"of W1 on this machine, more than `make bench` can give it, so it runs W1's first "
        f"{count} requests ({ours['prompt_tokens']} prompt and {ours['output_tokens']} output "
        f"tokens) at batch sizes {', '.join(sizes)}, beside our engine on the same "
        f"requests with `max_num_seqs {count}`, in the same dtype. `generate` gets the prompts "
        "left-padded and runs until the batch's longest output is done; each request is "
        "credited only with its own tokens, and its E2E is its batch's end, when `generate` "
        "hands results back.",
        _code(
            f"pagedserve bench throughput --dataset w1 --num-prompts {count} "
            f"--max-num-seqs {count} --baseline transformers "
            f"--baseline-batch-sizes {','.join(sizes)}{context.weights_flag}"
        ),
        _offline_rows(context, runs),
        f"Our engine: **{_ratio(ours, best)}** the output tokens/s of transformers' `generate` "
        f"at its best batch size here, {best['batch_size']}.",
    )


def _join(*parts: str) -> str:
    return "\n\n".join(part.strip("\n") for part in parts if part) + "\n"


def fastest(summaries: list[dict]) -> dict:
    """The run summary with the most output tokens/s."""
    return max(summaries, key=lambda summary: summary["output_throughput"])


def fastest_of_rounds(summaries: list[dict]) -> dict:
    """The fastest of one engine's runs, with the output tokens/s of each run in the order run."""
    rates = [summary["output_throughput"] for summary in summaries]
    return fastest(summaries) | {"round_output_throughputs": rates}


def output_ratio(ours: dict, other: dict) -> float:
    """Output tokens/s of one run summary over another's."""
    return ours["output_throughput"] / other["output_throughput"]


def _ratio(ours: dict, other: dict) -> str:
    return f"{output_ratio(ours, other):.2f}x"


def _e2e(summary: dict, quantile: str) -> str:
    return f"{summary['e2e_ms'][quantile] / 1000:.1f} s"


def kv_usage(context: Context, runs: list[OfflineRun]) -> str:
    layout = context.setup.kv_layout
    per_token = layout.bytes_per_token
    block_bytes = per_token * layout.block_size
    rows = []
    for run in runs:
        paged = max(r.kv_blocks_used for r in run.steps) * block_bytes
        seats = max(len(r.running) for r in run.steps)
        reserved = max(r.reserved_tokens for r in run.steps) * per_token
        contiguous = seats * layout.max_model_len * per_token
        rows.append(
            [run.name, _mib(paged), _mib(reserved), _mib(contiguous), f"{contiguous / paged:.0f}x"]
        )
    plots.kv_usage_plot(runs, context.plots_dir / "w1_kv_cache.png")
    header = [
        "run",
        "paged, peak",
        "contiguous prompt + max_tokens, peak",
        f"contiguous max_model_len ({layout.max_model_len}), peak",
        "max_model_len / paged",
    ]
    return f"""## KV cache usage over time on W1

The KV cache held after every step of the W1 runs above ({per_token / 1024:.1f} KiB per token,
blocks of {layout.block_size} tokens), against what an allocator reserving one contiguous region
per seated request would have held for the same batch at the same step: either the request's
prompt plus `max_tokens`, or the model's whole context (`max_model_len`), as servers without paging
must when they do not know the output length.

{markdown_table(header, rows)}

{context.image("w1_kv_cache.png", "KV cache memory over time on W1")}"""


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB"


def sweep(context: Context, points: list[dict], config) -> str:
    slo = config.sweep_slo
    best = largest_meeting(points, slo)
    plots.sweep_plot(points, slo, best, context.plots_dir / "sweep.png")
    limits = " and ".join(f"p99 {k.upper()} <= {v:g} ms" for k, v in slo.as_dict().items())
    verdict = f"No batch size meets {limits} on this machine."
    if best is not None:
        verdict = (
            f"The largest batch that meets {limits} is **max_num_seqs "
            f"{best['batch_size']}**, at {best['output_throughput']:.1f} output tokens/s."
        )
    sizes = ",".join(str(p["batch_size"]) for p in points)
    slo_arg = ",".join(f"{k}={v:g}" for k, v in slo.as_dict().items())
    prompt_len, output_len = config.sweep_prompt_len, config.sweep_output_len
    return _join(
        "## What raising the batch size costs: the max_num_seqs sweep",
        "W1 cannot run at batch 1 within the time `make bench` has (8,632 tokens at a few "
        "tokens/s), so each point runs one fixed wave instead: max_num_seqs requests of "
        f"{prompt_len} prompt and {output_len} output tokens, all arriving at once. Every "
        "request is seated from the first step, so TTFT is the prefill of the whole batch and "
        "TPOT the pace of a decode step at that batch size. (One engine, built with the largest "
        "max_num_seqs, runs every point: a wave of b requests is scheduled exactly as under "
        "max_num_seqs b.)",
        _code(
            f"pagedserve bench sweep --batch-sizes {sizes} --prompt-len {prompt_len} "
            f"--output-len {output_len} --slo {slo_arg}{context.weights_flag}"
        ),
        sweep_table(
            points,
            lambda p: _fraction(context, p["total_token_throughput"], p["batch_size"]),
        ),
        verdict,
        context.image("sweep.png", "Throughput against TPOT and TTFT as max_num_seqs grows"),
    )


def seed_timeline(context: Context, segments: dict[str, list[Segment]]) -> str:
    plots.timeline_plot(segments, context.plots_dir / "seed_timeline.png")
    starts = {
        policy: min(s.first_step for s in parts if s.request == "C")
        for policy, parts in segments.items()
    }
    held = sum(s.last_step - s.first_step + 1 for s in segments["static"] if s.state == HELD)
    return f"""## The seed scenario, step by step

Two seats (`max_num_seqs 2`); A needs 8 tokens, B 64, C (8 tokens) waits. Under continuous
batching C takes A's seat at step {starts["continuous"]}, the step after A finishes; under static
batching A's finished result is held and its seat stays idle for {held} steps, until B is done,
and C starts at step {starts["static"]}.

{context.image("seed_timeline.png", "Which request holds which seat at each step")}"""


def serving(context: Context, summary: dict, config, batch: int) -> str:
    spec = config.serve_dataset
    inputs, outputs = (
        f"{spec.input_len[0]}:{spec.input_len[1]}",
        f"{spec.output_len[0]}:{spec.output_len[1]}",
    )
    slo_arg = ",".join(f"{k}={v:g}" for k, v in config.serve_slo.as_dict().items())
    return _join(
        "## Serving over HTTP: `bench serve` against `pagedserve serve`",
        f"A real server process (`max_num_seqs {batch}`) and the benchmark client on the same "
        "machine (the client's own CPU use slows the server a little). "
        f"{spec.num_prompts} requests of {inputs} prompt and {outputs} output tokens (random "
        "token ids, sent as ids, so that the server counts exactly the prompt lengths drawn), "
        f"arriving as a Poisson process at {config.serve_rate:g} request/s. Output token counts "
        "come from the server's usage chunk.",
        _code(
            f"pagedserve serve --max-num-seqs {batch}{context.weights_flag} &",
            f"pagedserve bench serve --dataset random --num-prompts {spec.num_prompts} "
            f"--input-len {inputs} --output-len {outputs} --request-rate {config.serve_rate:g} "
            f"--slo {slo_arg}",
        ),
        serve_table(summary),
        "Client-side TTFT runs from sending the request to the first streamed chunk with output: "
        "it includes queueing in the server, HTTP and the client's own event loop. The server's "
        "TTFT histogram (`pagedserve:time_to_first_token_seconds`, read from its `/metrics` "
        "before and after the run) starts when the engine accepts the request. The gap between "
        "the two is what the server's own logs do not show.",
        _ttft_comparison(summary),
    )


def _ttft_comparison(summary: dict) -> str:
    client, server = summary["ttft_ms"], summary["server_ttft"]
    header = ["TTFT (ms)", "mean", *(f"p{q}" for q in QUANTILES)]
    rows = [["client (what users feel)", client["mean"], *(client[f"p{q}"] for q in QUANTILES)]]
    if server is None:
        return markdown_table(header, rows) + "\n\nThe server exported no TTFT histogram."
    rows.append(
        [
            "server histogram (interpolated within buckets)",
            server["mean_ms"],
            *(server[f"p{q}_ms"] for q in QUANTILES),
        ]
    )
    buckets = [
        [f"<= {b['le_s']}", b["server"], b["client"]]
        for b in server["buckets"]
        if b["server"] or b["client"]
    ]
    bucket_header = ["TTFT bucket (s)", "server count", "client count"]
    return markdown_table(header, rows) + "\n\n" + markdown_table(bucket_header, buckets)


def prefix_caching(engine_args: dict) -> str:
    return format_markdown(run_prefix_caching_benchmark(**engine_args))
