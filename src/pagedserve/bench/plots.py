"""The benchmark figures, as small PNGs (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: the benchmarks run on machines without a display

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import LogLocator, ScalarFormatter

from pagedserve.bench.metrics import Slo
from pagedserve.bench.offline import OfflineRun
from pagedserve.bench.records import Run
from pagedserve.bench.timeline import HELD, Segment

DPI = 90
_COLORS = {"continuous": "tab:blue", "static": "tab:orange", "transformers": "tab:gray"}


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


def sweep_plot(points: list[Run], slo: Slo, best: Run | None, path: Path) -> Path:
    """TPOT and TTFT (p50, p99) against output tokens/s, one point per max_num_seqs."""
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    throughput = [p.output_throughput for p in points]
    for ax, name, limit in zip(axes, ("tpot", "ttft"), (slo.tpot, slo.ttft), strict=True):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(throughput, [_ms(p, name, q) for p in points], style, label=q)
        for p, x in zip(points, throughput, strict=True):
            ax.annotate(
                str(p.batch_size),
                (x, _ms(p, name, "p99")),
                fontsize=7,
                textcoords="offset points",
                xytext=(3, 4),
            )
        if limit is not None:
            ax.axhline(limit, color="red", lw=0.8, label=f"SLO {limit:g} ms")
        if best is not None:
            ax.plot(
                best.output_throughput,
                _ms(best, name, "p99"),
                "r*",
                ms=14,
                label=f"largest batch meeting SLO: {best.batch_size}",
            )
        ax.set(
            xlabel="output tokens/s",
            ylabel=f"{name.upper()} (ms)",
            yscale="log",
            title=f"{name.upper()} against throughput (labels: max_num_seqs)",
        )
        # Plain numbers on the log axis: "300", not "3 x 10^2".
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.legend(fontsize=7)
    return _save(figure, path)


def _ms(run: Run, latency: str, quantile: str) -> float:
    return getattr(getattr(run, f"{latency}_ms"), quantile)


def policies_plot(runs: list[OfflineRun], path: Path) -> Path:
    """Output tokens/s per policy, and each one's distribution of E2E latency."""
    figure, (bars, cdf) = plt.subplots(1, 2, figsize=(10, 4))
    names = [run.name for run in runs]
    colors = [_COLORS.get(name, "tab:green") for name in names]
    rates = [run.output_tokens / run.duration_s for run in runs]
    bars.bar(names, rates, color=colors)
    for x, rate in enumerate(rates):
        bars.text(x, rate, f"{rate:.1f}", ha="center", va="bottom", fontsize=8)
    bars.set(ylabel="output tokens/s", title="Throughput on W1")
    for run, color in zip(runs, colors, strict=True):
        e2e = np.sort(run.e2e_s)
        cdf.step(
            e2e, np.arange(1, len(e2e) + 1) / len(e2e), where="post", color=color, label=run.name
        )
    cdf.set(
        ylim=(0, 1.02),
        xlabel="E2E latency (s)",
        ylabel="fraction of requests done",
        title="E2E latency on W1 (all requests arrive at 0)",
    )
    cdf.legend(fontsize=8)
    return _save(figure, path)


def timeline_plot(segments: dict[str, list[Segment]], path: Path) -> Path:
    """One panel per policy: which request holds which seat at each engine step."""
    figure, axes = plt.subplots(
        len(segments), 1, figsize=(10, 1.3 + 1.1 * len(segments)), sharex=True
    )
    colors = {"A": "tab:blue", "B": "tab:orange", "C": "tab:green"}
    for ax, (policy, parts) in zip(np.atleast_1d(axes), segments.items(), strict=True):
        for s in parts:
            held = s.state == HELD
            ax.broken_barh(
                [(s.first_step, s.last_step - s.first_step + 1)],
                (s.seat - 0.4, 0.8),
                facecolors="white" if held else colors.get(s.request, "tab:gray"),
                edgecolor=colors.get(s.request, "tab:gray"),
                hatch="//" if held else None,
            )
            label = f"{s.request} done, held" if held else s.request
            ax.text(
                (s.first_step + s.last_step + 1) / 2,
                s.seat,
                label,
                ha="center",
                va="center",
                fontsize=8,
            )
        ax.set(yticks=[0, 1], yticklabels=["seat 0", "seat 1"], title=policy)
    np.atleast_1d(axes)[-1].set_xlabel("engine step")
    return _save(figure, path)


def kv_usage_plot(runs: list[OfflineRun], path: Path) -> Path:
    """KV cache held over time, against what contiguous per-request reservations would need."""
    figure, ax = plt.subplots(figsize=(10, 4))
    for run in runs:
        layout = run.setup.kv_layout
        times = [r.time - run.started for r in run.steps]
        block_bytes = layout.bytes_per_token * layout.block_size
        used = [r.kv_blocks_used * block_bytes / 2**20 for r in run.steps]
        color = _COLORS.get(run.name, "tab:green")
        ax.plot(times, used, color=color, label=f"{run.name}: paged blocks in use")
        if run.name == "continuous":
            seated = [
                len(r.running) * layout.max_model_len * layout.bytes_per_token / 2**20
                for r in run.steps
            ]
            reserved = [r.reserved_tokens * layout.bytes_per_token / 2**20 for r in run.steps]
            ax.plot(
                times,
                seated,
                ":",
                color="black",
                label=f"contiguous, max_model_len ({layout.max_model_len}) per seat",
            )
            ax.plot(
                times,
                reserved,
                "--",
                color="tab:red",
                label="contiguous, prompt + max_tokens per seat",
            )
    ax.set(
        xlabel="time since the run started (s)",
        ylabel="KV cache (MiB)",
        yscale="log",
        title="KV cache memory on W1",
    )
    ax.legend(fontsize=8)
    return _save(figure, path)
