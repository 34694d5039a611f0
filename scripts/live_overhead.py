"""What watching costs: W1 through `pagedserve bench serve` against a fresh server, with nobody on
the live page's feed and with one viewer reading /engine/events, taking turns.

    .venv/bin/python scripts/live_overhead.py [--rounds 2]

writes docs/bench/<kind of this CPU>/AB-live-page.md, which BENCHMARKS.md includes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from datetime import date
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pagedserve.model.cpu_features import CpuFeatures  # noqa: E402
from pagedserve.server.process import LocalServer  # noqa: E402

SETTINGS = ("nobody watching", "one viewer")


def run(watched: bool, result: Path) -> dict:
    with LocalServer([]) as server:
        stop = threading.Event()
        snapshots = []

        def view() -> None:
            url = f"{server.base_url}/engine/events"
            try:
                with httpx.stream("GET", url, timeout=None) as events:
                    for line in events.iter_lines():
                        if line.startswith("data:"):
                            snapshots.append(len(line))
                        if stop.is_set():
                            return
            except httpx.RemoteProtocolError:
                return  # the server stopped at the end of the run

        viewer = threading.Thread(target=view, daemon=True)
        if watched:
            viewer.start()
        command = [
            sys.executable, "-m", "pagedserve.cli", "bench", "serve", "--base-url",
            server.base_url, "--dataset", "w1", "--no-progress", "--result-file", str(result),
        ]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True)
        stop.set()
    figures = json.loads(result.read_text())
    figures["snapshots"] = len(snapshots)
    figures["snapshot_bytes"] = sum(snapshots) / max(len(snapshots), 1)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name in SETTINGS:
                figures = run(name == "one viewer", Path(tmp) / "r.json")
                runs[name].append(figures)
                print(name, f"{figures['output_throughput']:.1f} tok/s", figures["snapshots"])
    cpu = CpuFeatures.host()
    out = ROOT / "docs" / "bench" / cpu.kind / "AB-live-page.md"
    out.write_text(render(cpu, runs))
    print(out)


def render(cpu: CpuFeatures, runs: dict[str, list[dict]]) -> str:
    best = {name: max(f["output_throughput"] for f in figures) for name, figures in runs.items()}
    lines = [
        f"## The live page's feed: what watching costs on {cpu.kind} ({date.today()})",
        "",
        "W1 (64 requests at once) through `pagedserve bench serve` against a fresh `pagedserve "
        "serve` with its defaults, with nobody reading /engine/events and with one viewer "
        "reading it (the page's feed: a snapshot every 0.25 s), taking turns "
        f"(`scripts/live_overhead.py`). Watched against unwatched, best of each: "
        f"{best['one viewer'] / best['nobody watching']:.3f}x.",
        "",
        "| setting | round | output tokens/s | TTFT p50 | E2E p50 | snapshots (mean bytes) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, figures in runs.items():
        for index, f in enumerate(figures, start=1):
            snapshots = f"{f['snapshots']} ({f['snapshot_bytes']:.0f})" if f["snapshots"] else "-"
            lines.append(
                f"| {name} | {index} | {f['output_throughput']:.1f} | {f['ttft_ms']['p50']:.0f} ms "
                f"| {f['e2e_ms']['p50']:.0f} ms | {snapshots} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
