"""Markdown tables, used both for printed results and for BENCHMARKS.md."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedserve.bench.metrics import LATENCIES, QUANTILES
from pagedserve.bench.records import Distribution, Run, ServeRun

LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    # Names in the first column, left; figures after it, right, as a reader scans them.
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def distribution_row(name: str, stats: Distribution) -> list[object]:
    return [name, stats.mean, *(getattr(stats, f"p{q}") for q in QUANTILES)]


def latency_table(summary: ServeRun) -> str:
    """One row per latency (TTFT, TPOT, ITL, E2E): mean and percentiles in ms."""
    header = ["latency (ms)", "mean", *(f"p{q}" for q in QUANTILES)]
    rows = []
    for name in LATENCIES:
        stats = getattr(summary, f"{name}_ms")
        if stats is not None:
            rows.append(distribution_row(LATENCY_NAMES[name], stats))
    return markdown_table(header, rows)


def serve_table(summary: ServeRun) -> str:
    """The headline counts and rates of a `bench serve` run, then its latencies."""
    rows: list[list[object]] = [
        ["requests completed / failed", f"{summary.completed} / {summary.failed}"],
        ["duration (s)", summary.duration_s],
        [
            "prompt / output tokens",
            f"{summary.total_prompt_tokens:,} / {summary.total_output_tokens:,}",
        ],
        ["request throughput (req/s)", summary.request_throughput],
        ["output throughput (tokens/s)", summary.output_throughput],
        ["total throughput (tokens/s)", summary.total_token_throughput],
    ]
    if summary.goodput is not None and summary.slo_ms:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in summary.slo_ms.items())
        rows.append([f"goodput (req/s; {slo})", summary.goodput])
    return markdown_table(["metric", "value"], rows) + "\n\n" + latency_table(summary)


def offline_table(runs: list[Run]) -> str:
    """One row per in-process run: throughput and E2E percentiles."""
    header = [
        "run",
        "max_num_seqs",
        "output tokens/s",
        "total tokens/s",
        "duration (s)",
        "E2E p50 (ms)",
        "E2E p90 (ms)",
        "E2E p99 (ms)",
    ]
    rows = [
        [
            r.name,
            r.batch_size,
            r.output_throughput,
            r.total_token_throughput,
            r.duration_s,
            r.e2e_ms.p50,
            r.e2e_ms.p90,
            r.e2e_ms.p99,
        ]
        for r in runs
    ]
    return markdown_table(header, rows)


def sweep_table(points: list[Run], of_ideal: Callable[[Run], str] | None = None) -> str:
    """One row per batch size; of_ideal, when given, adds a column with each point's throughput
    as a fraction of the machine's ideal."""
    header = ["max_num_seqs", "output tokens/s"]
    header += ["of ideal"] if of_ideal else []
    header += ["TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)"]
    rows = []
    for p in points:
        row = [p.batch_size, p.output_throughput]
        row += [of_ideal(p)] if of_ideal else []
        latencies = (p.ttft_ms, p.tpot_ms)
        rows.append(row + [getattr(latency, q) for latency in latencies for q in ("p50", "p99")])
    return markdown_table(header, rows)
