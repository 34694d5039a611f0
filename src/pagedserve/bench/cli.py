"""`pagedserve bench serve|throughput|sweep|load|report`: argument parsing and printing only.

`bench serve` imports nothing of the engine: it measures any server over HTTP.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from pathlib import Path

from pydantic_core import to_json

from pagedserve.bench.datasets import DATASETS, DatasetSpec, parse_range
from pagedserve.bench.metrics import Slo
from pagedserve.engine_args import add_engine_args, engine_config

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def main(argv: list[str]) -> None:
    """`pagedserve bench ARGV`; `pagedserve` hands its arguments over, so that nothing of the
    benchmarks (nor their extra dependencies) is imported for the other commands."""
    args = build_parser().parse_args(argv)
    args.handler(args)


def build_parser() -> argparse.ArgumentParser:
    bench = argparse.ArgumentParser(prog="pagedserve bench", description=__doc__)
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    serve = kinds.add_parser("serve", help="drive an OpenAI-compatible server over HTTP")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--endpoint", choices=ENDPOINTS, default=ENDPOINTS[0])
    serve.add_argument("--model", default=None, help="served model name (default: the server's)")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--request-rate", type=float, default=math.inf, help="req/s (inf: at once)")
    serve.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--request-timeout", type=float, default=None, help="seconds per read")
    serve.add_argument("--no-progress", dest="progress", action="store_false")
    _add_dataset_args(serve)
    _add_slo_arg(serve)
    _add_result_file_arg(serve)
    serve.set_defaults(handler=_serve)

    throughput = kinds.add_parser("throughput", help="a workload through LLM.generate, offline")
    throughput.add_argument(
        "--baseline",
        choices=("transformers", "llama.cpp"),
        default=None,
        help="llama.cpp runs the model's GGUF file with max_num_seqs parallel sequences",
    )
    throughput.add_argument(
        "--baseline-batch-sizes",
        default=None,
        help="comma-separated batch sizes for transformers, one run each (default: max_num_seqs)",
    )
    _add_dataset_args(throughput)
    add_engine_args(throughput)
    _add_result_file_arg(throughput)
    throughput.set_defaults(handler=_throughput)

    sweep = kinds.add_parser("sweep", help="throughput against latency as max_num_seqs grows")
    sweep.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128")
    sweep.add_argument("--prompt-len", type=int, default=16)
    sweep.add_argument("--output-len", type=int, default=16)
    sweep.add_argument("--plot", type=Path, default=Path("sweep.png"))
    add_engine_args(sweep)
    _add_slo_arg(sweep, default="tpot=200")
    _add_result_file_arg(sweep)
    sweep.set_defaults(handler=_sweep)

    load = kinds.add_parser("load", help="real sizes from their files: start, memory, decode")
    load.add_argument("--sizes", default="1.1b", help="comma-separated: 1.1b, 7b")
    load.add_argument("--work-dir", type=Path, default=Path("/tmp/pagedserve-load"))
    load.add_argument("--threads", type=int, default=os.cpu_count())
    load.add_argument("--plots-dir", type=Path, default=Path("docs/bench"))
    load.set_defaults(handler=_load)

    report = kinds.add_parser("report", help="run every benchmark and write BENCHMARKS.md")
    report.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"))
    report.add_argument(
        "--plots-dir",
        type=Path,
        default=Path("docs/bench"),
        help="results, plots and REPORT.md, in a folder per kind of host",
    )
    report.add_argument(
        "--render-only",
        action="store_true",
        help="measure nothing: rewrite --output from the results kept under --plots-dir",
    )
    report.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2)")
    report.add_argument("--dtype", default="auto")
    report.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    report.set_defaults(handler=_report)
    return bench


def _add_dataset_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset", choices=DATASETS, default="random")
    group.add_argument("--num-prompts", type=int, default=64, help="w1: its first N (all 64)")
    group.add_argument("--input-len", type=parse_range, default=(8, 128), help="MIN:MAX or N")
    group.add_argument("--output-len", type=parse_range, default=(8, 256), help="MIN:MAX or N")
    group.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: common part")
    group.add_argument(
        "--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes, at random"
    )
    group.add_argument("--dataset-seed", type=int, default=0)
    group.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the model's)")


def _add_slo_arg(parser: argparse.ArgumentParser, default: str = "") -> None:
    parser.add_argument(
        "--slo",
        type=Slo.parse,
        default=Slo.parse(default),
        help="ttft=MS,tpot=MS,e2e=MS (any subset)",
    )


def _add_result_file_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--result-file", type=Path, default=None, help="write results as JSON")


def _dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    return DatasetSpec(
        name=args.dataset,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        seed=args.dataset_seed,
    )


def _requests(args: argparse.Namespace, need_tokenizer: bool, model: str | None = None):
    """The dataset's requests, and the tokenizer when one was needed: --tokenizer, else the
    tokenizer of model (a checkpoint or .gguf), else SmolLM2's."""
    from pagedserve.bench.datasets import build_requests, load_tokenizer

    spec = _dataset_spec(args)
    tokenizer = None
    if need_tokenizer or spec.name != "w1":
        path = args.tokenizer
        if path is None and model is not None:
            from pagedserve.model.source import resolve_model_dir

            path = resolve_model_dir(model)
        tokenizer = load_tokenizer(path)
    return build_requests(spec, tokenizer), tokenizer


def _write(result: object, path: Path | None) -> None:
    """Writes result (records, or lists and dicts of them) as JSON."""
    if path is not None:
        path.write_bytes(to_json(result, indent=2) + b"\n")
        print(f"results written to {path}")


def _serve(args: argparse.Namespace) -> None:
    from pagedserve.bench.client import Target
    from pagedserve.bench.serve import ServeConfig, run_serve_benchmark
    from pagedserve.bench.tables import serve_table

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    target = Target(args.base_url, args.endpoint, args.model, args.api_key)
    requests, tokenizer = _requests(args, need_tokenizer=target.chat)
    config = ServeConfig(
        target=target,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        slo=args.slo,
        progress=args.progress,
        request_timeout=args.request_timeout,
    )
    summary = run_serve_benchmark(config, requests, tokenizer)
    print(serve_table(summary))
    for failure in summary.failures:
        print(f"request {failure.index} failed: {failure.error}")
    _write(summary, args.result_file)


def _throughput(args: argparse.Namespace) -> None:
    from pagedserve.bench.records import fastest, output_ratio
    from pagedserve.bench.tables import offline_table
    from pagedserve.bench.throughput import run_throughput

    requests, _ = _requests(args, need_tokenizer=False, model=args.model)
    sizes = _int_list(args.baseline_batch_sizes) if args.baseline_batch_sizes else ()
    runs = [
        run.summary()
        for run in run_throughput(vars(engine_config(args)), requests, args.baseline, sizes)
    ]
    print(offline_table(runs))
    if runs[0].all_reduce_share is not None:
        print(f"\nrank 0's time in all-reduces: {runs[0].all_reduce_share:.1%} of the run")
    if len(runs) > 1:
        best = fastest(runs[1:])
        print(
            f"\n{runs[0].name} / {best.name} at batch {best.batch_size} (its best) "
            f"output tokens/s: {output_ratio(runs[0], best):.2f}x"
        )
    _write({"runs": runs}, args.result_file)


def _sweep(args: argparse.Namespace) -> None:
    from pagedserve.bench.plots import sweep_plot
    from pagedserve.bench.sweep import largest_meeting, run_sweep
    from pagedserve.bench.tables import sweep_table

    engine_args = vars(engine_config(args))
    batch_sizes = _int_list(args.batch_sizes)
    points = run_sweep(engine_args, batch_sizes, args.prompt_len, args.output_len)
    best = largest_meeting(points, args.slo)
    print(sweep_table(points))
    print(
        f"largest max_num_seqs meeting p99 {args.slo.as_dict()} ms:",
        best.batch_size if best else "none",
    )
    print(f"plot written to {sweep_plot(points, args.slo, best, args.plot)}")
    _write({"points": points, "slo_ms": args.slo.as_dict()}, args.result_file)


def _report(args: argparse.Namespace) -> None:
    if args.render_only:
        from pagedserve.bench.render import write_benchmarks

        print(f"report written to {write_benchmarks(args.plots_dir, args.output)}")
        return
    from pagedserve.bench.report import ReportConfig, write_report

    config = ReportConfig(
        model=args.model, dtype=args.dtype, plots_dir=args.plots_dir, threads=args.threads
    )
    print(f"report written to {write_report(config, args.output)}")


def _load(args: argparse.Namespace) -> None:
    from pagedserve.bench.load import run_load
    from pagedserve.bench.render import write_benchmarks
    from pagedserve.model.cpu_features import CpuFeatures

    sizes = [size.strip() for size in args.sizes.split(",")]
    out_dir = args.plots_dir / CpuFeatures.host().kind
    path = run_load(out_dir, args.work_dir, sizes, args.threads)
    print(path.read_text())
    print(f"report written to {write_benchmarks(args.plots_dir, Path('BENCHMARKS.md'))}")


def _int_list(text: str) -> tuple[int, ...]:
    """'8,16,32' -> (8, 16, 32)."""
    return tuple(int(item) for item in text.split(","))
