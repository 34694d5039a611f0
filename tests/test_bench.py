"""Benchmarks: metric formulas, workloads, the timing helper, and short runs on a tiny model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import ServerProcess

from pagedserve import LLM
from pagedserve.bench.arrivals import arrival_offsets
from pagedserve.bench.client import Target
from pagedserve.bench.datasets import (
    BenchRequest,
    DatasetSpec,
    build_requests,
    chat_template_overhead,
    load_tokenizer,
    ordinary_token_ids,
    parse_range,
    text_with_length,
    w1_requests,
)
from pagedserve.bench.metrics import RequestResult, Slo, summarize
from pagedserve.bench.records import Distribution, Run, StepCounts
from pagedserve.bench.serve import ServeConfig, run_serve_benchmark
from pagedserve.bench.server_metrics import Histogram
from pagedserve.bench.sweep import flat_batch_size, largest_meeting
from pagedserve.timing import Stopwatch, device_clock, synchronize

# Metric formulas on a synthetic stream.


def _result(start: float, chunks: list[float], output_tokens: int, end: float | None = None):
    return RequestResult(
        start=start,
        end=chunks[-1] if end is None else end,
        token_times=chunks,
        prompt_tokens=10,
        output_tokens=output_tokens,
    )


def test_request_metrics_follow_their_definitions():
    result = _result(10.0, [10.5, 10.6, 10.8, 11.0], output_tokens=4, end=11.2)
    assert result.ttft == pytest.approx(0.5)
    assert result.itls == pytest.approx([0.1, 0.2, 0.2])
    assert result.e2e == pytest.approx(1.2)
    assert result.tpot == pytest.approx((1.2 - 0.5) / 3)
    assert _result(0.0, [0.3], output_tokens=1).tpot is None


def test_summary_percentiles_throughput_goodput_and_failures():
    fast = _result(0.0, [0.2, 0.3, 0.4], output_tokens=3)
    slow = _result(0.0, [0.6, 1.0, 1.4], output_tokens=3)
    failed = RequestResult(start=0.0, error="HTTP 500: boom")
    summary = summarize([fast, failed, slow], duration=2.0, slo=Slo(ttft=500, tpot=500))
    assert (summary.completed, summary.failed) == (2, 1)
    assert [(f.index, f.error) for f in summary.failures] == [(1, "HTTP 500: boom")]
    assert summary.request_throughput == pytest.approx(1.0)
    assert summary.output_throughput == pytest.approx(3.0)
    assert summary.total_token_throughput == pytest.approx((20 + 6) / 2.0)
    ttft = summary.ttft_ms
    assert ttft.mean == pytest.approx(400)
    assert ttft.p50 == pytest.approx(400)
    assert ttft.p99 == pytest.approx(200 + 0.99 * 400)  # numpy's linear interpolation
    assert summary.tpot_ms.mean == pytest.approx((100 + 400) / 2)
    assert summary.itl_ms.p50 == pytest.approx(250)  # gaps 100, 100, 400, 400
    assert summary.e2e_ms.p90 == pytest.approx(400 + 0.9 * 1000)
    # Only `fast` meets TTFT <= 500 ms.
    assert summary.good_requests == 1
    assert summary.goodput == pytest.approx(0.5)


def test_slo_parsing():
    assert Slo.parse("ttft=500,tpot=50").as_dict() == {"ttft": 500.0, "tpot": 50.0}
    assert Slo.parse("").as_dict() == {}
    with pytest.raises(ValueError, match="ttft=MS"):
        Slo.parse("latency=3")


# Workloads.


def test_w1_is_the_fixed_workload():
    requests = w1_requests()
    assert len(requests) == 64
    assert sum(r.prompt_len for r in requests) == 4429
    assert sum(r.output_len for r in requests) == 8632
    assert all(8 <= r.prompt_len <= 128 and 8 <= r.output_len <= 256 for r in requests)
    assert all(1000 <= t < 40000 for r in requests for t in r.prompt_token_ids)
    assert [r.prompt_token_ids for r in w1_requests()] == [r.prompt_token_ids for r in requests]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_random_and_shared_prefix_lengths(tokenizer):
    special = set(tokenizer.all_special_ids)
    spec = DatasetSpec("random", num_prompts=50, input_len=(5, 9), output_len=(3, 4))
    requests = build_requests(spec, tokenizer)
    assert len(requests) == 50
    assert {r.prompt_len for r in requests} <= set(range(5, 10))
    assert {r.output_len for r in requests} == {3, 4}
    assert not special & {t for r in requests for t in r.prompt_token_ids}

    spec = DatasetSpec("shared-prefix", num_prompts=6, input_len=(2, 3), prefix_len=20)
    requests = build_requests(spec, tokenizer)
    prefix = requests[0].prompt_token_ids[:20]
    assert all(r.prompt_token_ids[:20] == prefix for r in requests)
    assert {r.prompt_len - 20 for r in requests} <= {2, 3}
    assert len({tuple(r.prompt_token_ids) for r in requests}) == 6

    spec = DatasetSpec("shared-prefix", num_prompts=40, prefix_len=20, num_prefixes=3)
    requests = build_requests(spec, tokenizer)
    prefixes = {tuple(r.prompt_token_ids[:20]) for r in requests}
    assert len(prefixes) == 3
    assert tuple(prefix) in prefixes  # the first of them is the one-prefix dataset's


def test_text_is_made_to_encode_to_the_asked_length(tokenizer):
    vocabulary = ordinary_token_ids(tokenizer)
    rng = np.random.default_rng(1)
    for length in (1, 7, 40, 128):
        text = text_with_length(
            tokenizer, rng.choice(vocabulary, length).tolist(), length, vocabulary
        )
        assert len(tokenizer.encode(text, add_special_tokens=False)) == length
    assert chat_template_overhead(tokenizer) > 0


def test_parse_range():
    assert parse_range("8:128") == (8, 128)
    assert parse_range("64") == (64, 64)
    with pytest.raises(ValueError):
        parse_range("9:3")


def test_arrivals():
    assert not arrival_offsets(5, math.inf).any()
    offsets = arrival_offsets(4000, rate=4.0, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.1)
    # Gamma gaps with shape k have a coefficient of variation of 1 / sqrt(k).
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)
    bursty = np.diff(arrival_offsets(4000, rate=4.0, burstiness=0.25, seed=1))
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)


def test_histogram_quantiles_interpolate_within_buckets():
    before = Histogram([0.1, 0.2, math.inf], [1, 1, 1], 0.05)
    after = Histogram([0.1, 0.2, math.inf], [3, 7, 8], 2.0)
    run = after.minus(before)
    assert run.count == 7 and run.bucket_counts() == [2, 4, 1]
    assert run.quantile(0.5) == pytest.approx(0.1 + 0.1 * (3.5 - 2) / 4)
    assert run.quantile(1.0) == 0.2  # beyond the last finite bound, the bound is all we know


def test_largest_batch_meeting_an_slo_and_where_decode_steps_cost_the_same():
    def point(batch: int, tpot_p99: float) -> Run:
        def dist(p99: float) -> Distribution:
            return Distribution(mean=p99, p50=p99, p90=p99, p99=p99)

        return Run(
            name="continuous",
            batch_size=batch,
            num_requests=batch,
            duration_s=1.0,
            prompt_tokens=batch,
            output_tokens=batch,
            output_throughput=batch,
            total_token_throughput=2 * batch,
            e2e_ms=dist(1000),
            ttft_ms=dist(10 * batch),
            tpot_ms=dist(tpot_p99),
        )

    points = [point(b, tpot) for b, tpot in ((1, 50), (2, 60), (4, 90), (8, 150))]
    assert largest_meeting(points, Slo(tpot=100)).batch_size == 4
    assert largest_meeting(points, Slo(tpot=100, ttft=25)).batch_size == 2
    assert largest_meeting(points, Slo(tpot=10)) is None
    for point_, step_s in zip(points, (0.020, 0.021, 0.024, 0.040), strict=True):
        point_.steps = StepCounts(
            steps=4,
            release_step_p50=4,
            prefill_steps=1,
            prefill_step_mean_s=0.1,
            decode_steps=3,
            decode_step_mean_s=step_s,
            seconds_in_prefill_steps=0.1,
        )
    assert flat_batch_size(points) == 2  # 0.024 s is more than 1.1 x 0.020 s
    assert flat_batch_size(points, tolerance=1.25) == 4


# The timing helper.


def test_device_clock_synchronizes_cuda_before_reading_the_clock(monkeypatch):
    synchronized: list[tuple[torch.device, float]] = []

    def fake_synchronize(device=None):
        time.sleep(0.05)  # as if the device still had 50 ms of queued work
        synchronized.append((device, time.perf_counter()))

    monkeypatch.setattr(torch.cuda, "synchronize", fake_synchronize)
    clock = device_clock("cuda:1")
    assert synchronized[0][0] == torch.device("cuda:1")
    assert clock >= synchronized[0][1]
    with Stopwatch(torch.device("cuda:0")) as watch:
        pass
    # Both ends wait for the device: the block is billed its queued work.
    assert len(synchronized) == 3 and watch.seconds >= 0.05
    synchronize("cpu")
    assert len(synchronized) == 3  # CPU work is synchronous: nothing to wait for


def test_bench_serve_side_imports_neither_torch_nor_the_engine():
    code = (
        "import sys, pagedserve.bench.serve, pagedserve.cli; "
        "bad = [m for m in ('torch', 'pagedserve.engine.llm_engine') if m in sys.modules]; "
        "sys.exit(str(bad) if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# Short runs against a real server and in process, on a tiny model.


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(checkpoint):
    process = ServerProcess("--model", str(checkpoint), "--dtype", "float32")
    yield process
    process.close()


def test_bench_serve_against_a_real_server(server, tokenizer):
    requests = build_requests(DatasetSpec("random", 8, (4, 24), (2, 12), seed=3), tokenizer)
    config = ServeConfig(Target(server.base_url), request_rate=50.0, progress=False)
    summary = run_serve_benchmark(config, requests)
    assert summary.failed == 0, summary.failures
    assert summary.completed == 8
    assert summary.total_prompt_tokens == sum(r.prompt_len for r in requests)
    assert summary.total_output_tokens == sum(r.output_len for r in requests)
    assert summary.ttft_ms.p50 > 0 and summary.e2e_ms.p99 >= summary.ttft_ms.p99
    assert summary.server_ttft.count == 8
    assert sum(b.client for b in summary.server_ttft.buckets) == 8


def test_bench_serve_command_on_the_chat_endpoint(server, tmp_path, capsys):
    from pagedserve.cli import main

    result_file = tmp_path / "result.json"
    command = (
        f"bench serve --base-url {server.base_url} --endpoint /v1/chat/completions "
        "--num-prompts 4 --input-len 40:60 --output-len 3 --max-concurrency 2 --no-progress "
        f"--slo ttft=60000 --result-file {result_file}"
    )
    main(command.split())
    summary = json.loads(result_file.read_text())
    assert summary["failed"] == 0, summary["failures"]
    assert summary["total_output_tokens"] == 12
    # Prompts longer than the template: text was made to count exactly the drawn lengths.
    assert summary["total_prompt_tokens"] == summary["requested"]["prompt_tokens"]
    assert summary["good_requests"] == 4
    assert "TTFT" in capsys.readouterr().out


def test_llama_cpp_baseline_refuses_a_checkpoint_directory(checkpoint):
    from pagedserve.cli import main

    command = f"bench throughput --model {checkpoint} --num-prompts 2 --baseline llama.cpp"
    with pytest.raises(SystemExit) as exit_info:
        main(command.split())
    assert str(exit_info.value) == (
        f"pagedserve: error: baseline llama.cpp: model '{checkpoint}' is no GGUF file"
    )


def test_seed_scenario_timeline(checkpoint):
    from pagedserve.bench.timeline import HELD, RUNNING, run_seed_scenario

    engine_args = {"model": str(checkpoint), "dtype": "float32"}
    continuous = run_seed_scenario(engine_args, "continuous")
    static = run_seed_scenario(engine_args, "static")
    assert _as_tuples(continuous) == [
        (0, "A", RUNNING, 0, 7),
        (1, "B", RUNNING, 0, 63),
        (0, "C", RUNNING, 8, 15),
    ]
    assert _as_tuples(static) == [
        (0, "A", RUNNING, 0, 7),
        (1, "B", RUNNING, 0, 63),
        (0, "A", HELD, 8, 63),
        (0, "C", RUNNING, 64, 71),
    ]


def _as_tuples(segments) -> list[tuple]:
    return [(s.seat, s.request, s.state, s.first_step, s.last_step) for s in segments]


def test_offline_runs_credit_each_request_its_own_tokens(checkpoint, tmp_path):
    from pagedserve.bench.plots import kv_usage_plot, policies_plot
    from pagedserve.bench.throughput import run_throughput

    requests = w1_requests()[:5]
    engine_args = {"model": str(checkpoint), "dtype": "float32", "max_num_seqs": 2}
    ours, baseline, one_batch = run_throughput(engine_args, requests, "transformers", (2, 5))
    for run in (ours, baseline, one_batch):
        assert len(run.e2e_s) == 5
        assert run.prompt_tokens == sum(r.prompt_len for r in requests)
        assert run.output_tokens == sum(r.output_len for r in requests)
    assert [run.batch_size for run in (ours, baseline, one_batch)] == [2, 2, 5]
    # Request-level batches of 2, 2 and 1: each batch's members share their E2E.
    assert len(set(baseline.e2e_s)) == 3
    assert len(set(one_batch.e2e_s)) == 1
    assert max(len(record.running) for record in ours.steps) == 2
    assert ours.steps[-1].kv_blocks_used == 0
    assert sum(len(record.released) for record in ours.steps) == 5
    assert sum(record.first_tokens for record in ours.steps) == 5
    steps = ours.summary().steps
    assert steps.steps == len(ours.steps) >= steps.prefill_steps + steps.decode_steps
    for path in (
        policies_plot([ours, baseline], tmp_path / "p.png"),
        kv_usage_plot([ours], tmp_path / "kv.png"),
    ):
        assert path.read_bytes().startswith(b"\x89PNG")


def test_step_counts_bound_what_continuous_batching_gains(checkpoint):
    """Two seats; A needs 3 tokens, B 9, C 5. Continuous: A is back after step 3, C takes its
    seat at step 4 and is back after step 8, B after step 9. Static: A and B are handed back
    together after step 9; C is seated at step 10 and back after step 14."""
    from functools import partial

    from pagedserve.bench.offline import run_engine, with_fresh_llm
    from pagedserve.bench.render import step_count_bound

    requests = [BenchRequest(list(range(100, 100 + n)), out) for n, out in ((5, 3), (6, 9), (7, 5))]
    engine_args = {"model": str(checkpoint), "dtype": "float32", "max_num_seqs": 2}
    continuous, static = (
        with_fresh_llm(
            engine_args, partial(run_engine, requests=requests), scheduler=policy
        ).summary()
        for policy in ("continuous", "static")
    )
    assert (continuous.steps.steps, continuous.steps.release_step_p50) == (9, 8)
    assert (static.steps.steps, static.steps.release_step_p50) == (14, 9)
    assert step_count_bound(continuous, static) == (14 / 9, 8 / 9)


def test_sweep_runs_one_wave_per_batch_size(checkpoint):
    from pagedserve.bench.sweep import run_sweep

    points = run_sweep({"model": str(checkpoint), "dtype": "float32"}, (1, 3), 5, 4)
    assert [p.batch_size for p in points] == [1, 3]
    assert [p.output_tokens for p in points] == [4, 12]
    # One wave: every request is seated at once, so they share the first and the last steps.
    assert all(p.steps.prefill_steps == 1 for p in points)
    assert all(p.tpot_ms.p50 > 0 for p in points)


def test_decode_step_profile_accounts_for_the_step(checkpoint):
    from pagedserve.bench.speed import STEP_PHASES, profile_decode_steps

    llm = LLM(str(checkpoint), dtype="float32", max_num_seqs=3)
    profiles = [profile_decode_steps(llm, batch, prompt_len=5, steps=3) for batch in (1, 3)]
    for profile in profiles:
        assert set(profile.phase_ms) == set(STEP_PHASES)
        # The phases are laps of one clock inside the step, the wall time is read around it.
        assert 0 < sum(profile.phase_ms.values()) <= profile.step_ms
        assert 0 < profile.overhead_share < 1
        assert profile.top_ops_ms and all(ms >= 0 for _, ms in profile.top_ops_ms)
        assert sum(ms for _, ms in profile.top_ops_ms) <= profile.profiled_step_ms
        assert profile.fewest_running == profile.batch
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_decode_step_profile_times_the_whole_batch_after_long_prompts(checkpoint):
    """Prompts beyond a step's token budget are computed over several steps, and the first ones
    done start decoding: they must still be running in every timed step."""
    from pagedserve.bench.speed import profile_decode_steps

    llm = LLM(str(checkpoint), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8)
    profile = profile_decode_steps(llm, 4, prompt_len=6, steps=3)
    assert profile.fewest_running == 4
    assert not llm.engine.has_unfinished_requests()


def test_constrained_steps_time_the_same_batch_with_and_without_masks(checkpoint):
    from pagedserve.bench.speed import STEP_PHASES, constrained_steps

    llm = LLM(str(checkpoint), dtype="float32", max_num_seqs=3)
    measured = [constrained_steps(llm, batch, prompt_len=5, steps=3) for batch in (1, 3)]
    for steps in measured:
        assert set(steps.phase_ms) == set(steps.constrained_phase_ms) == set(STEP_PHASES)
        assert 0 < sum(steps.phase_ms.values()) <= steps.step_ms
        assert 0 < sum(steps.constrained_phase_ms.values()) <= steps.constrained_step_ms
        assert steps.constraint == "[a-z ]{400}"
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("chunked", [False, True])
def test_long_prompt_load_serves_every_token(checkpoint, chunked):
    from pagedserve.bench.speed import LongPromptLoad, run_long_prompt_load

    load = LongPromptLoad(
        streams=3,
        stream_prompt_len=4,
        stream_output_len=12,
        long_prompt_len=60,
        long_output_len=2,
        long_arrivals_s=(0.0, 0.05),
    )
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=16 if chunked else 256,
    )
    result = run_long_prompt_load(llm, load)
    streams, long_prompts = result.streams, result.long_prompts
    assert result.chunked_prefill is chunked
    assert streams.completed == 3 and streams.total_output_tokens == 36
    assert streams.itl_ms.p50 > 0
    assert long_prompts.completed == 2 and long_prompts.total_output_tokens == 4
    assert long_prompts.total_prompt_tokens == 120
    assert not llm.engine.has_unfinished_requests()


def test_server_reports_its_peak_memory(server):
    assert server.peak_rss_bytes() > 50 * 2**20


def test_gguf_weight_bytes_count_every_tensor_at_its_quantized_size():
    from gguf import GGML_QUANT_SIZES, GGUFReader

    from pagedserve.bench.llama_cpp_peer import gguf_weight_bytes
    from pagedserve.model.source import default_gguf_path

    path = default_gguf_path()
    tensors = GGUFReader(path).tensors
    expected = 0
    for tensor in tensors:
        block_size, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        expected += int(tensor.n_elements) // block_size * block_bytes
    assert gguf_weight_bytes(path) == expected
    # Every tensor of SmolLM2-135M (30 layers of 9 plus the embedding and final norm), mostly
    # 4-bit: about 0.6 bytes per weight, the whole file but its header.
    assert len(tensors) == 272
    assert 0.9 * path.stat().st_size < expected < path.stat().st_size


def test_report_writes_every_section(checkpoint, tmp_path):
    from pagedserve.bench.cli import main
    from pagedserve.bench.records import HostResults, KQuants, output_ratio
    from pagedserve.bench.render import SEATED_ROWS, step_count_bound
    from pagedserve.bench.render import targets as render_targets
    from pagedserve.bench.report import POLICIES, ReportConfig, write_report
    from pagedserve.bench.speed import LongPromptLoad
    from pagedserve.model.cpu_features import CpuFeatures

    config = ReportConfig(
        model=str(checkpoint),
        dtype="float32",
        plots_dir=tmp_path / "bench",
        baseline_requests=2,
        baseline_batch_sizes=(1, 2),
        sweep_batch_sizes=(8, 16),
        sweep_prompt_len=4,
        sweep_output_len=4,
        serve_dataset=DatasetSpec("random", 4, (4, 8), (2, 4)),
        serve_rate=50.0,
        single_stream=(8, 8),
        single_stream_rounds=2,
        agreement_requests=2,
        agreement_output_len=4,
        profile_batches=(1, 4),
        constrained_batches=(1, 3),
        long_prompt_load=LongPromptLoad(4, 4, 8, 48, 2, (0.0,)),
        chunked_budget=16,
    )
    # Another kind of host measured before: its results stay, and BENCHMARKS.md shows both.
    kind = CpuFeatures.host().kind
    host_dir = tmp_path / "bench" / kind
    benchmarks = write_report(config, tmp_path / "BENCHMARKS.md").read_text()
    results = (host_dir / "results.json").read_text()
    host = HostResults.model_validate_json(results)
    other = host.model_copy(deep=True)
    other.machine.kind, other.date = "other-cpu-avx2", "2026-01-02"
    # Its run had the GGUF Q4_K_M stage (it needs llama-cpp-python and a GGUF model): figures
    # of this run's, relabelled.
    ours_runs = [host.details.single_stream[0], *host.details.single_stream[2:4]]
    source_run, q4_k_m_run, llama_run = (
        run.model_copy(update={"name": name})
        for run, name in zip(
            ours_runs, ("ours on a.gguf", "ours on a.Q4_K_M.gguf", "llama.cpp"), strict=True
        )
    )
    other.details.k_quants = KQuants(
        source="a.gguf",
        gguf="a.Q4_K_M.gguf",
        file_map_bytes=100 * 2**20,
        held_map_bytes=105 * 2**20,
        single_stream=[source_run, q4_k_m_run, llama_run],
        w1_all_seated=[q4_k_m_run, llama_run],
    )
    k_rows = [t for t in render_targets(other.details, other.machine) if t.number == "30"]
    assert len(k_rows) == 2 and (k_rows[0].goal, k_rows[0].met) == ("<= 1.15x", True)
    ratio = q4_k_m_run.decode_tokens_per_s / source_run.decode_tokens_per_s
    assert k_rows[1].measured.startswith(f"{ratio:.2f}x") and k_rows[1].met == (ratio >= 0.9)
    (tmp_path / "bench" / "other-cpu-avx2").mkdir()
    (tmp_path / "bench" / "other-cpu-avx2" / "results.json").write_text(other.model_dump_json())
    (tmp_path / "bench" / "a-gpu").mkdir()
    gpu_section = "## GPU: A\n\nIts [log](gpu_check.log); see [vLLM](https://docs.vllm.ai).\n"
    (tmp_path / "bench" / "a-gpu" / "GPU.md").write_text(gpu_section)
    ab_section = "## Requests without constraints on other-cpu-avx2\n\n| round |\n"
    (tmp_path / "bench" / "other-cpu-avx2" / "AB-constraints.md").write_text(ab_section)
    main(["report", "--render-only", "--plots-dir", str(tmp_path / "bench"),
          "--output", str(tmp_path / "BENCHMARKS.md")])  # fmt: skip
    both = (tmp_path / "BENCHMARKS.md").read_text()
    assert f"[{kind}](bench/{kind}/REPORT.md) ({host.date})" in benchmarks
    assert "other-cpu-avx2" not in benchmarks
    assert both.index(f"[{kind}]") < both.index("[other-cpu-avx2](bench/other-cpu-avx2/REPORT.md)")
    assert both.count("## Targets on ") == 2 and both.count("| 6.1 | W1 output tokens/s") == 2
    assert both.count("GGUF K-quants on ") == 1 and "| ours on a.Q4_K_M.gguf | " in both
    assert both.count("Structured outputs on ") == 2
    assert both.count("Chat content read as text on ") == 2
    assert both.count(ab_section) == 1 and both.index(ab_section) < both.index(gpu_section[:9])
    chat = host.details.chat_tokenizing
    assert chat.messages == 20 and 3900 < chat.tokens < 4400 and chat.text_cost > 0
    # A GPU's hand-written section comes last, its relative links made relative to the output.
    assert both.rstrip().endswith(
        "## GPU: A\n\nIts [log](bench/a-gpu/gpu_check.log); see [vLLM](https://docs.vllm.ai)."
    )
    assert "for the file's\n100 MiB" in both
    assert HostResults.model_validate_json(results) == host  # JSON round trip, field by field
    for plot in ("w1_policies.png", "w1_kv_cache.png", "sweep.png", "seed_timeline.png"):
        assert (host_dir / plot).read_bytes().startswith(b"\x89PNG")

    report = (host_dir / "REPORT.md").read_text()
    for heading in (
        "## Continuous against static batching on W1",
        "### Where decode steps cost the same",
        "## Against transformers' `generate`",
        "## KV cache usage over time on W1",
        "## The seed scenario, step by step",
        "## Prefix caching",
        "## Engine speed targets",
        "### W1 with every request seated: offline and over HTTP",
        "### Where a decode step's time goes",
        "### What structured outputs cost per step",
        "### What reading chat content as text costs",
        "### Long prompts arriving: chunked prefill",
    ):
        assert heading in report
    assert "{{" not in report and "{%" not in report
    targets = report.split("## Engine speed targets")[1].split("###")[0]
    assert targets.count("\n| ") == 1 + len(host.targets)
    assert len(host.targets) == 10  # no llama.cpp row: the checkpoint is no GGUF file
    d = host.details
    # The ceilings are measured first and again last; the higher of each rate counts.
    stage_names = list(d.stage_seconds)
    assert (stage_names[0], stage_names[-1]) == ("ceilings", "ceilings again")
    flops = [m.matmul_gflops["float32"] for m in d.ceilings.measurements]
    assert len(flops) == 2 and d.ceilings.matmul_gflops["float32"] == max(flops)
    assert d.ceilings.bandwidth_gbs == max(m.bandwidth_gbs for m in d.ceilings.measurements)
    assert f"(float32 matmul {flops[0]:.1f} then {flops[1]:.1f} GFLOP/s;" in report
    assert d.http.failed == 0 and d.http.total_output_tokens == 8632
    assert [p.batch for p in d.profiles] == [1, 4]
    narrow = ("bfloat16", "int8", "q4_1", "q4_1_q8", "bfloat16_bf16")
    narrow_runs = [f"ours, {dtype} packed weights" for dtype in narrow]
    assert [run.name for run in d.single_stream] == ["ours", "transformers", *narrow_runs]
    assert [run.output_tokens for run in d.single_stream] == [8] * 7
    # Two rounds, the engines taking turns; each keeps its faster run.
    assert [name for name in stage_names if "single" in name] == [
        "single stream 1",
        "single stream 2",
    ]
    for run in d.single_stream:
        rates = run.round_output_throughputs
        assert len(rates) == 2 and run.output_throughput == max(rates)
        assert f"{run.name} {rates[0]:.1f}, {rates[1]:.1f}" in report
    # The checkpoint is no GGUF file, so llama.cpp has nothing to run.
    assert d.llama_cpp is None
    assert "llama.cpp was not measured in this run" in report
    variants = [{"packed_weight_dtype": dtype} for dtype in narrow]
    names = [*narrow, "bfloat16 KV cache"]
    for agreement, variant, name in zip(
        d.agreement, [*variants, {"kv_cache_dtype": "bfloat16"}], names, strict=True
    ):
        assert agreement.variant == variant
        assert (agreement.requests, agreement.output_tokens) == (2, 8)
        assert f"{name}: {agreement.identical} of 2 identical" in report
    continuous, static = (run.steps for run in d.policies)
    assert f"would give\n**{static.steps / continuous.steps:.2f}x** static's" in report
    # Two rounds of each policy, taking turns; the tables hold each policy's faster run.
    turns = [f"W1 {policy} at 16 seats, round {n}" for n in (1, 2) for policy in POLICIES]
    assert stage_names[1:5] == turns
    # Again where the sweep's decode steps cost about the same, the target's batch size.
    flat = flat_batch_size(d.sweep)
    flat_continuous, flat_static = d.flat_policies
    assert flat in (8, 16) and flat_continuous.batch_size == flat_static.batch_size == flat
    flat_turns = [f"W1 {policy} at {flat} seats, round {n}" for n in (1, 2) for policy in POLICIES]
    after_sweep = stage_names.index("sweep") + 1
    if flat == 16:  # the runs at 16 seats serve for both
        assert d.flat_policies == d.policies and stage_names[after_sweep] == "seed timeline"
    else:
        assert stage_names[after_sweep : after_sweep + 4] == flat_turns
    share = output_ratio(flat_continuous, flat_static) / step_count_bound(*d.flat_policies)[0]
    assert f"{100 * share:.0f}% ({output_ratio(flat_continuous, flat_static):.2f}x" in targets
    durations = report.split("Durations in the order run:")[1].split("\n\n")[0]
    for run in d.policies:
        assert f"{run.duration_s:.1f}" in durations
        assert run.duration_s == min(d.policy_durations[run.name])
    # W1 all seated, offline and over HTTP taking turns; the targets use each one's faster run.
    rounds = [f"W1 all seated{'' if row == 'float32' else f', {row}'}" for row in SEATED_ROWS]
    assert [name for name in stage_names if "seated" in name or "HTTP" in name] == [
        f"{name} {round_}" for round_ in (1, 2) for name in [*rounds, "W1 over HTTP"]
    ]
    http_rates = [run.output_throughput for run in d.http_rounds]
    assert d.http.output_throughput == max(http_rates)
    for row, label in SEATED_ROWS.items():
        runs = d.seated[row]
        assert [run.output_tokens for run in runs] == [8632, 8632]
        assert d.fastest_seated(row).duration_s == min(run.duration_s for run in runs)
        assert f"{row} {', '.join(f'{run.output_throughput:.1f}' for run in runs)}" in report
        assert f"| {label.format(seats=64)} |" in report
    assert d.seated["q4_1"][0].packed_weight_dtype == "q4_1"
    # Invariance's price: the default's row against --batch-invariant false's.
    invariant, variant = (d.fastest_seated(r) for r in ("q4_1", "q4_1, not batch-invariant"))
    ratio = invariant.output_throughput / variant.output_throughput
    assert "| 39 | W1 offline, all seated: the batch-invariant default" in targets
    assert f"| >= 0.95x | {ratio:.2f}x ({invariant.output_throughput:.1f} output" in targets
    # An AVX-512 VNNI host's W1 goal holds for its fastest path: auto's or q4_1_q8's with a
    # bfloat16 KV cache.
    wide = host.machine.model_copy(update={"cpu": f"{host.machine.cpu} (AVX-512 VNNI)"})
    (w1,) = (t for t in render_targets(d, wide) if t.name.startswith("W1 offline, all 64"))
    rates = [d.fastest_seated(r).output_throughput for r in ("q4_1", "q4_1_q8, bfloat16 KV cache")]
    assert w1.measured.startswith(f"{max(rates):.1f} output tokens/s (auto's q4_1 {rates[0]:.1f}")
    assert f"q4_1_q8 with a bfloat16 KV cache {rates[1]:.1f}" in w1.measured
    assert w1.met == (max(rates) >= 600)
    # The target rows run float32 packed weights, whatever auto would pick.
    assert "(the rows below pin these unless they say otherwise) | float32 |" in report
    # and so do the commands shown beside them: both policies, the baseline, the sweep, bench
    # serve's server, and W1's offline and server commands.
    assert report.count("--packed-weight-dtype float32") == 7
    assert [run.batch_size for run in d.baseline] == [2, 1, 2]
    best = max(d.baseline[1:], key=lambda run: run.output_throughput)
    assert f"at its best batch size here, {best.batch_size}." in report
