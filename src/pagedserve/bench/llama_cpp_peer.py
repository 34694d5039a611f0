"""A peer: llama.cpp, through its Python binding llama-cpp-python, on a GGUF file as its users
would run it (for the default model, the embedded Q4_1 file itself).

Optional: `make bench` installs llama-cpp-python (pip builds llama.cpp from source, once); without
it the benchmarks report the peer as not installed. A request is timed as ours are: TTFT at its
first token, TPOT over the tokens after it, greedy, with the end-of-sequence token ignored
(`Llama.generate` yields tokens until it is stopped, whatever they are).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from pagedserve.bench.datasets import BenchRequest
from pagedserve.bench.offline import WARM_UP, OfflineRun

NAME = "llama.cpp (llama-cpp-python)"


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_weight_bytes(gguf_path: Path) -> int:
    """Bytes of every tensor in the file: what one decode step reads, the embedding table
    included, since it is also the output projection of a model with tied embeddings."""
    from gguf import GGUFReader

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(gguf_path).tensors)


def run_llama_cpp(request: BenchRequest, gguf_path: Path, threads: int) -> OfflineRun:
    """One request alone, after a warm-up request."""
    from llama_cpp import Llama

    context_len = max(r.prompt_len + r.output_len for r in (request, WARM_UP))
    model = Llama(
        model_path=str(gguf_path),
        n_ctx=context_len,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    _token_times(model, WARM_UP)
    started = time.perf_counter()
    token_times = _token_times(model, request)
    duration = time.perf_counter() - started
    first, last = token_times[0], token_times[-1]
    return OfflineRun(
        name=NAME,
        batch_size=1,
        duration_s=duration,
        prompt_tokens=request.prompt_len,
        output_tokens=request.output_len,
        e2e_s=[last],
        ttft_s=[first],
        tpot_s=[(last - first) / (request.output_len - 1)] if request.output_len > 1 else [],
    )


def _token_times(model, request: BenchRequest) -> list[float]:
    """Seconds from the start of the request to each of its tokens, greedy. reset() drops the
    previous request's tokens, which generate would otherwise reuse as a cached prefix."""
    model.reset()
    started, times = time.perf_counter(), []
    for _ in model.generate(request.prompt_token_ids, top_k=1, temp=0.0, reset=True):
        times.append(time.perf_counter() - started)
        if len(times) == request.output_len:
            break
    return times
