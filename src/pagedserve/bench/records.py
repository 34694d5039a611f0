"""The benchmarks' results as typed records: what each benchmark returns, what
`docs/bench/<kind>/results.json` keeps, and what the report is rendered from.

pydantic models, so that results read back from JSON are checked field by field (a record written
by an older report that lacks a field fails loudly instead of rendering a blank).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Distribution(Record):
    """Mean and percentiles of a latency, in ms."""

    mean: float
    p50: float
    p90: float
    p99: float


class StepCounts(Record):
    """How many steps a run took, when its median request was handed back (in steps), and what a
    step cost with and without a prefill ending in it."""

    steps: int
    release_step_p50: float | None
    prefill_steps: int
    prefill_step_mean_s: float | None
    decode_steps: int
    decode_step_mean_s: float | None
    seconds_in_prefill_steps: float


class Run(Record):
    """A workload through one engine in this process: ours, transformers or llama.cpp."""

    name: str
    batch_size: int
    num_requests: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    output_throughput: float
    total_token_throughput: float
    e2e_ms: Distribution
    ttft_ms: Distribution | None = None  # None where the run cannot see first tokens
    tpot_ms: Distribution | None = None
    steps: StepCounts | None = None  # ours only
    packed_weight_dtype: str | None = None  # ours with the weights packed as this, when pinned
    step_bytes: float | None = None  # weight bytes a decode step reads, where the report needs it
    round_output_throughputs: list[float] = []  # every round's, in the order run
    # Under tensor parallelism: the share of the run rank 0 spent in all-reduces.
    all_reduce_share: float | None = None

    @property
    def decode_tokens_per_s(self) -> float:
        assert self.tpot_ms is not None, f"{self.name} has no decode phase"
        return 1000 / self.tpot_ms.p50


class Failure(Record):
    index: int
    error: str


class TtftBucket(Record):
    le_s: str
    server: int
    client: int


class ServerTtft(Record):
    """The server's own TTFT histogram for a run, beside the client's TTFTs in its buckets."""

    count: float
    mean_ms: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    buckets: list[TtftBucket]


class ServeRun(Record):
    """Requests with their own arrival times and token timestamps (`bench serve`, or the engine
    driven as a server drives it)."""

    num_requests: int
    completed: int
    failed: int
    failures: list[Failure]
    duration_s: float
    total_prompt_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None
    itl_ms: Distribution | None
    e2e_ms: Distribution | None
    slo_ms: dict[str, float] | None = None
    good_requests: int | None = None
    goodput: float | None = None
    requested: dict[str, int] | None = None  # prompt and output tokens the workload asked for
    server_ttft: ServerTtft | None = None
    config: dict[str, str | float | int | None] | None = None
    server_peak_rss_bytes: int | None = None


def fastest(runs: Sequence[Run]) -> Run:
    """The run with the most output tokens/s."""
    return max(runs, key=lambda run: run.output_throughput)


def fastest_of_rounds(runs: Sequence[Run]) -> Run:
    """One engine's fastest run, carrying the output tokens/s of every round in the order run."""
    rates = [run.output_throughput for run in runs]
    return fastest(runs).model_copy(update={"round_output_throughputs": rates})


def output_ratio(ours: Run | ServeRun, other: Run | ServeRun) -> float:
    return ours.output_throughput / other.output_throughput


# The engine's phase timers, in the order of a step (engine.phase_timer).
STEP_PHASES = ("schedule", "prepare", "forward", "sample", "output")


class StepProfile(Record):
    """Decode steps at one batch size: wall time, the engine's own phase timers, and the
    operators that took the most time in a profiled repeat of the same steps."""

    batch: int
    context_len: int  # tokens per sequence at the first profiled step
    step_ms: float
    phase_ms: dict[str, float]  # per step, from engine.phase_timer
    top_ops_ms: list[tuple[str, float]]  # per step, from torch.profiler (self time)
    profiled_step_ms: float  # per step under the profiler, which adds its own overhead
    fewest_running: int  # sequences in the emptiest timed step: batch, unless one finished early

    @property
    def overhead_share(self) -> float:
        """The part of a step spent outside the model forward."""
        total = sum(self.phase_ms.values())
        return (total - self.phase_ms["forward"]) / total


class ConstrainedSteps(Record):
    """Decode steps at one batch size without constraints, then with every row held to a regex
    (bench/speed.py's constrained_steps): what structured outputs cost per step."""

    batch: int
    constraint: str  # the regex every row is held to
    step_ms: float  # wall time per step, no row constrained
    constrained_step_ms: float  # every row constrained
    phase_ms: dict[str, float]  # per step, from engine.phase_timer
    constrained_phase_ms: dict[str, float]

    @property
    def mask_ms(self) -> float:
        """What constraints add per step to sampling (masks filled and applied) and to output
        (each matcher fed its token)."""
        return sum(
            self.constrained_phase_ms[phase] - self.phase_ms[phase]
            for phase in ("sample", "output")
        )


class ChatTokenizing(Record):
    """One conversation through the chat template to ids (bench/chat_tokens.py), best of its
    rounds: control tokens in content parsed, kept as text, and kept as text when every message
    spells one."""

    messages: int
    tokens: int
    parse_ms: float
    text_ms: float
    forged_text_ms: float

    @property
    def text_cost(self) -> float:
        return self.text_ms / self.parse_ms


class LongPromptRun(Record):
    """Streams decoding while long prompts arrive, with or without chunked prefill."""

    streams: ServeRun
    long_prompts: ServeRun
    chunked_prefill: bool
    max_num_batched_tokens: int

    @property
    def itl_spread(self) -> float:
        """The streams' ITL p99 over their p50."""
        assert self.streams.itl_ms is not None
        return self.streams.itl_ms.p99 / self.streams.itl_ms.p50


class Agreement(Record):
    """Greedy outputs of a variant (packed weights, KV cache dtype) against the reference's."""

    variant: dict[str, str]
    requests: int
    output_tokens: int
    identical: int
    mean_share_before_divergence: float

    @property
    def name(self) -> str:
        if "kv_cache_dtype" in self.variant:
            return f"{self.variant['kv_cache_dtype']} KV cache"
        return self.variant["packed_weight_dtype"]


class PrefixCachingRun(Record):
    ttft_p50_s: float
    ttft_p99_s: float
    output_tokens_per_s: float
    peak_kv_blocks: int
    prefix_cache_hit_rate: float | None
    duration_s: float
    num_steps: int
    num_preemptions: int


class PrefixCaching(Record):
    num_requests: int
    system_prompt_tokens: int
    suffix_tokens: int
    output_tokens: int
    on: PrefixCachingRun
    off: PrefixCachingRun


class KvLayout(Record):
    bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int

    @property
    def budget_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token


class KvUsage(Record):
    """A W1 run's peak KV cache, paged, against contiguous reservations for the same seats."""

    name: str
    paged_bytes: int
    reserved_bytes: int  # prompt + max_tokens per seated request
    contiguous_bytes: int  # max_model_len per seat


class CeilingsMeasurement(Record):
    matmul_gflops: dict[str, float]
    bandwidth_gbs: float


class Ceilings(Record):
    matmul_gflops: dict[str, float]  # by dtype name
    bandwidth_gbs: float  # bytes read per second, in 1e9
    threads: int  # torch's intra-op threads while these were measured
    # Mean microseconds of a decode-sized product, by thread count (CPU only).
    small_product_us: dict[int, float] = {}
    # The rates of each measurement these are the best of (see best_of), in the order measured.
    measurements: list[CeilingsMeasurement] = []

    @staticmethod
    def best_of(measured: list[Ceilings]) -> Ceilings:
        """The highest of each rate over measurements of one machine at different times: a busy
        spell on a shared machine only slows a measurement down. The decode-sized product's
        times are the first measurement's."""
        first = measured[0]
        return Ceilings(
            matmul_gflops={
                name: max(c.matmul_gflops[name] for c in measured) for name in first.matmul_gflops
            },
            bandwidth_gbs=max(c.bandwidth_gbs for c in measured),
            threads=first.threads,
            small_product_us=first.small_product_us,
            measurements=[
                CeilingsMeasurement(matmul_gflops=c.matmul_gflops, bandwidth_gbs=c.bandwidth_gbs)
                for c in measured
            ],
        )


class ModelCost(Record):
    weight_elements: int  # every weight, read once per decode step
    element_size: int  # bytes per weight, in the model's dtype
    packed_elements: int  # of those, the linear maps' (the tied output projection included)
    logits_elements: int  # of those, the output projection's
    flops_per_token: float

    @property
    def weight_bytes(self) -> int:
        return self.weight_elements * self.element_size

    def compute_bound(self, ceilings: Ceilings, dtype: str) -> float:
        """Tokens/s at the measured matmul rate: the bound at any batch size."""
        return 1e9 * ceilings.matmul_gflops[dtype] / self.flops_per_token

    def bandwidth_bound(self, ceilings: Ceilings, step_bytes: float | None = None) -> float:
        """Tokens/s of one stream that reads step_bytes (default: every weight) once per token."""
        return 1e9 * ceilings.bandwidth_gbs / (step_bytes or self.weight_bytes)

    def ideal(self, ceilings: Ceilings, dtype: str, batch: int) -> float:
        """Tokens/s (prompt and output alike) the hardware allows at this batch size."""
        return min(self.compute_bound(ceilings, dtype), batch * self.bandwidth_bound(ceilings))


class Machine(Record):
    cpu: str  # model, family/model and instruction sets
    kind: str  # the name its results are kept under (CpuFeatures.kind)
    cores: int
    torch_threads: int
    native_bfloat16: bool
    torch: str
    python: str
    cuda: str | None


class Setup(Record):
    """What the runs ran on: the model, its dtype and packing, the KV cache, the work per token."""

    model: str
    dtype: str
    device: str
    packed_weight_dtype: str | None  # None: the linear weights as loaded, for F.linear
    kv_layout: KvLayout
    cost: ModelCost


class LlamaCpp(Record):
    gguf: str
    step_bytes: int
    single_stream: Run
    w1_all_seated: Run


class KQuants(Record):
    """The model's GGUF file requantized to Q4_K_M by llama.cpp (bench/kquants.py), beside the
    file it came from and beside llama.cpp on it."""

    source: str  # the file it was made from
    gguf: str
    file_map_bytes: int  # what the Q4_K_M file stores for the blocks' linear maps
    held_map_bytes: int  # what our packed maps hold for them
    # One request alone, each one's fastest round: ours on the source, ours on Q4_K_M, llama.cpp
    # on Q4_K_M.
    single_stream: list[Run]
    w1_all_seated: list[Run]  # ours on Q4_K_M, llama.cpp on Q4_K_M

    @property
    def held_ratio(self) -> float:
        return self.held_map_bytes / self.file_map_bytes

    @property
    def single_stream_ratio(self) -> float:
        """Ours on Q4_K_M against ours on the source file, decode tokens/s."""
        source, q4_k_m, _ = self.single_stream
        return q4_k_m.decode_tokens_per_s / source.decode_tokens_per_s


class SeedTimeline(Record):
    """The seed scenario: the step at which C starts under each policy, and the steps A's seat
    stays idle under static batching."""

    c_starts: dict[str, int]
    held_steps: int


class Target(Record):
    number: str  # as the issues number their targets
    name: str
    goal: str
    measured: str
    met: bool


class Headline(Record):
    """The figures BENCHMARKS.md's summary shows for each kind of host: output tokens/s of W1
    with every request seated and decode tokens/s of one stream, by weight format; the ratios."""

    w1_all_seated: dict[str, float]  # by row: float32, q4_1, q4_1_q8, llama.cpp
    single_stream: dict[str, float]  # decode tokens/s, by the same rows
    against_transformers: float
    continuous_against_static: float
    step_count_bound: float


class Details(Record):
    """Everything one `bench report` run measured on one host, in the order the report shows it."""

    minutes: float
    load_average: tuple[float, float]  # 1-minute load at the start and at the end
    stage_seconds: dict[str, float]
    setup: Setup
    ceilings: Ceilings
    policies: list[Run]  # each policy's fastest W1 run: continuous, then static
    policy_durations: dict[str, list[float]] | None  # every run's, by policy, in the order run
    # The same at the sweep's largest batch size whose decode steps cost about the same
    # (sweep.flat_batch_size): continuous, then static.
    flat_policies: list[Run] | None = None
    kv_usage: list[KvUsage] | None
    baseline: list[Run]  # ours, then transformers at each batch size, on W1's first requests
    sweep: list[Run]
    seed: SeedTimeline | None
    serve: ServeRun
    prefix_caching: PrefixCaching | None
    seated: dict[str, list[Run]]  # W1 with every request seated, each round, by row (SEATED_ROWS)
    http_rounds: list[ServeRun]  # the same over HTTP, with the server's peak RSS
    # One request alone, each engine's fastest round: ours, transformers, ours packed narrower.
    single_stream: list[Run]
    llama_cpp: LlamaCpp | None  # None: llama-cpp-python missing, or the model is no GGUF file
    k_quants: KQuants | None = None  # as llama_cpp; None in results from before it ran
    agreement: list[Agreement]  # greedy outputs of float32 against narrower weights and KV cache
    profiles: list[StepProfile]
    long_prompts: list[LongPromptRun]  # without, then with chunked prefill
    constrained: list[ConstrainedSteps] | None = None  # None in results from before it ran
    chat_tokenizing: ChatTokenizing | None = None  # as constrained

    def ideal(self, batch: int) -> float:
        return self.setup.cost.ideal(self.ceilings, self.setup.dtype, batch)

    def bandwidth_bound(self, run: Run) -> float:
        return self.setup.cost.bandwidth_bound(self.ceilings, run.step_bytes)

    def fastest_seated(self, row: str) -> Run:
        return min(self.seated[row], key=lambda run: run.duration_s)

    @property
    def http(self) -> ServeRun:
        return max(self.http_rounds, key=lambda run: run.output_throughput)


class HostResults(Record):
    """docs/bench/<kind>/results.json: the latest `bench report` run on one kind of host."""

    date: str
    commit: str
    machine: Machine
    headline: Headline
    targets: list[Target]
    details: Details
