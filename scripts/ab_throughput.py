"""W1 offline (all 64 seated, the engine's defaults) at two commits, taking turns, each run a fresh
process on its own checkout and kernel build: whether a change moved throughput, beyond the tens of
percent that absolute figures move between runs on a shared machine.

    .venv/bin/python scripts/ab_throughput.py BEFORE AFTER --name SLUG --title "..." [--rounds 3]

writes docs/bench/<kind of this CPU>/AB-<SLUG>.md, which BENCHMARKS.md includes
(`pagedserve bench report`, or pagedserve.bench.render.write_benchmarks)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pagedserve.model.cpu_features import CpuFeatures  # noqa: E402


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True)
    return done.stdout


def run_w1(checkout: Path, extensions: Path, result: Path) -> dict:
    command = [
        sys.executable, "-c", "from pagedserve.cli import main; main()",
        "bench", "throughput", "--dataset", "w1", "--max-num-seqs", "64",
        "--result-file", str(result),
    ]  # fmt: skip
    env = {"PYTHONPATH": str(checkout / "src"), "TORCH_EXTENSIONS_DIR": str(extensions)}
    subprocess.run(command, check=True, env={**os.environ, **env}, capture_output=True)
    return json.loads(result.read_text())["runs"][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--name", required=True, help="the file's slug: AB-<name>.md")
    parser.add_argument("--title", required=True, help="what the two commits differ by")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cpu = CpuFeatures.host()
    revs = {label: git("rev-parse", "--short", rev).strip() for label, rev in
            (("before", args.before), ("after", args.after))}  # fmt: skip
    rows: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="pagedserve-ab-") as tmp:
        work = Path(tmp)
        for label, rev in revs.items():
            git("worktree", "add", "--detach", str(work / label), rev)
        try:
            for round_ in range(args.rounds):
                for label in rows:
                    run = run_w1(work / label, work / f"ext-{label}", work / f"{label}.json")
                    rows[label].append(run)
                    print(f"round {round_ + 1} {label}: {run['output_throughput']:.1f} tok/s")
        finally:
            for label in revs:
                git("worktree", "remove", "--force", str(work / label))
    out = ROOT / "docs" / "bench" / cpu.kind / f"AB-{args.name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(args.title, cpu, revs, rows))
    print(out)


def render(title: str, cpu: CpuFeatures, revs: dict, rows: dict) -> str:
    def tps(label: str) -> list[float]:
        return [run["output_throughput"] for run in rows[label]]

    lines = [
        f"## {title} on {cpu.kind} ({date.today()})",
        "",
        f"W1 offline, all 64 seated, the engine's defaults; {len(rows['before'])} rounds taking"
        " turns, each a fresh process on its own checkout"
        f" (`scripts/ab_throughput.py {revs['before']} {revs['after']}`).",
        "",
        f"| round | before, {revs['before']} (output tokens/s) "
        f"| after, {revs['after']} (output tokens/s) | after / before |",
        "|---:|---:|---:|---:|",
    ]
    for i, (b, a) in enumerate(zip(tps("before"), tps("after"), strict=True)):
        lines.append(f"| {i + 1} | {b:.1f} | {a:.1f} | {a / b:.3f} |")
    b, a = statistics.median(tps("before")), statistics.median(tps("after"))
    lines.append(f"| median | {b:.1f} | {a:.1f} | {a / b:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
