"""Two replicas on Ray, prefix-aware routing against round robin, taking turns: each round starts
a fresh `pagedserve serve -dp 2 --distributed-executor-backend ray` per policy and drives it with
`pagedserve bench serve --dataset shared-prefix` (16 prefixes of 384 tokens, more than one
replica's KV cache holds at once, so that where a request goes decides what stays cached).

    .venv/bin/python scripts/replica_bench.py [--rounds 2]

writes docs/bench/<kind of this CPU>/AB-replicas.md, which BENCHMARKS.md includes."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pagedserve.model.cpu_features import CpuFeatures  # noqa: E402
from pagedserve.server.process import LocalServer  # noqa: E402

POLICIES = {"prefix-aware": "prefix", "round robin": "round_robin"}
KV_CACHE = "320MiB"  # 7.3k tokens a replica: half the 16 prefixes' 6.1k tokens and the batch
SERVER = ["--distributed-executor-backend", "ray", "-dp", "2", "--kv-cache-memory", KV_CACHE]
WORKLOAD = [
    "--dataset", "shared-prefix", "--num-prefixes", "16", "--prefix-len", "384",
    "--input-len", "16:48", "--output-len", "16", "--num-prompts", "160",
    "--max-concurrency", "8", "--no-progress",
]  # fmt: skip


def counter(base_url: str, name: str) -> float:
    """A counter summed over every replica."""
    text = httpx.get(f"{base_url}/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))


def run(policy: str, result: Path) -> dict:
    with LocalServer([*SERVER, "--routing-policy", policy]) as server:
        names = ("pagedserve:prefix_cache_hits_total", "pagedserve:prefix_cache_queries_total")
        before = [counter(server.base_url, name) for name in names]
        command = [
            sys.executable, "-m", "pagedserve.cli", "bench", "serve",
            "--base-url", server.base_url, *WORKLOAD, "--result-file", str(result),
        ]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True)
        after = [counter(server.base_url, name) for name in names]
    hits, queries = (a - b for a, b in zip(after, before, strict=True))
    figures = json.loads(result.read_text())
    figures["hit_rate"] = hits / queries
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in POLICIES}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name, policy in POLICIES.items():
                figures = run(policy, Path(tmp) / "r.json")
                runs[name].append(figures)
                print(name, f"hit rate {figures['hit_rate']:.1%}",
                      f"TTFT p50 {figures['ttft_ms']['p50']:.0f} ms")  # fmt: skip
    cpu = CpuFeatures.host()
    out = ROOT / "docs" / "bench" / cpu.kind / "AB-replicas.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(cpu, runs))
    print(out)


def render(cpu: CpuFeatures, runs: dict[str, list[dict]]) -> str:
    lines = [
        f"## Replicas: prefix-aware routing against round robin on {cpu.kind} ({date.today()})",
        "",
        "The default model, two replicas on a local Ray instance, each on one core with a "
        f"{KV_CACHE} KV cache (7.3k tokens); `bench serve --dataset shared-prefix`: 160 "
        "requests over 16 prefixes of 384 tokens (drawn at random), a 16-48 token suffix, 16 "
        "output tokens, 8 at a time. Hit rate: prompt tokens found in the replicas' prefix "
        "caches over those looked up, from /metrics. Each round a fresh server per policy, "
        "taking turns (`scripts/replica_bench.py`); every round is shown.",
        "",
        "| routing | round | prefix-cache hit rate | TTFT p50 | TTFT p99 | E2E p50 | requests/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, figures_list in runs.items():
        for index, f in enumerate(figures_list, start=1):
            lines.append(
                f"| {name} | {index} | {f['hit_rate']:.1%} | {f['ttft_ms']['p50']:.0f} ms "
                f"| {f['ttft_ms']['p99']:.0f} ms | {f['e2e_ms']['p50']:.0f} ms "
                f"| {f['request_throughput']:.2f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
