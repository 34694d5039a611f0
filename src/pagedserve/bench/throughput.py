"""`pagedserve bench throughput`: a workload through LLM.generate, optionally against
transformers' generate on the same requests and dtype, at our batch size or at others, or
against llama.cpp on the model's GGUF file with as many parallel sequences as our seats."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch

from pagedserve.bench.datasets import BenchRequest
from pagedserve.bench.hf_baseline import run_transformers
from pagedserve.bench.llama_cpp_peer import llama_cpp_installed, run_llama_cpp_batched
from pagedserve.bench.offline import OfflineRun, run_engine, with_fresh_llm
from pagedserve.model.source import gguf_file


def run_throughput(
    engine_args: dict,
    requests: list[BenchRequest],
    baseline: str | None = None,
    baseline_batch_sizes: Sequence[int] = (),
) -> list[OfflineRun]:
    """Our run first, then the baseline's when one is asked for: transformers once per batch
    size in baseline_batch_sizes, or at our max_num_seqs when it is empty; llama.cpp with our
    max_num_seqs parallel sequences."""
    gguf_path = _llama_cpp_model(engine_args.get("model")) if baseline == "llama.cpp" else None
    runs = [with_fresh_llm(engine_args, partial(run_engine, requests=requests))]
    ours = runs[0]
    if baseline == "transformers":
        for batch_size in baseline_batch_sizes or [ours.batch_size]:
            runs.append(run_transformers(requests, batch_size, ours.setup))
    elif baseline == "llama.cpp":
        threads = torch.get_num_threads()
        runs.append(run_llama_cpp_batched(requests, gguf_path, threads, ours.batch_size))
    return runs


def _llama_cpp_model(model: str | None) -> Path:
    """Checked before our run, so that a baseline that cannot run fails at once."""
    gguf_path = gguf_file(model)
    if gguf_path is None:
        raise ValueError(f"baseline llama.cpp: model {model!r} is no GGUF file")
    if not llama_cpp_installed():
        raise ValueError(
            "baseline llama.cpp: llama-cpp-python is not installed (`make bench` installs it)"
        )
    return gguf_path
