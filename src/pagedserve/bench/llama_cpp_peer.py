"""A peer: llama.cpp, through its Python binding llama-cpp-python, on a GGUF file as its users
would run it (for the default model, the embedded Q4_1 file itself).

Optional: `make bench` installs llama-cpp-python (pip builds llama.cpp from source, once); without
it the benchmarks report llama.cpp as not measured. Requests are timed as ours are: TTFT at the
first token, TPOT over the tokens after it, E2E at the last, greedy, with the end-of-sequence
token ignored. One request alone runs through `Llama.generate`, which yields tokens until it is
stopped, whatever they are; a workload runs as llama.cpp's server runs its parallel slots: one
`llama_decode` a step over every sequence's next token, prompts filling the rest of the batch.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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
    return _timed_run([request], [token_times], time.perf_counter() - started, batch_size=1)


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


def run_llama_cpp_batched(
    requests: list[BenchRequest],
    gguf_path: Path,
    threads: int,
    parallel: int | None = None,
    batch_tokens: int = 2048,
) -> OfflineRun:
    """The requests, all arriving at once, on `parallel` sequences of one context (default: one
    each), each with a cache of its own, as llama-server runs `--parallel` slots, with its
    default batch of 2,048 tokens a step. A request waits for a free sequence in order."""
    import llama_cpp

    parallel = parallel or len(requests)

    longest_prompt = max(r.prompt_len for r in requests)
    if longest_prompt > batch_tokens:
        raise ValueError(
            f"batch_tokens: {batch_tokens} cannot hold a prompt of {longest_prompt} tokens"
        )
    # llama-cpp-python passes llama.cpp's log to this logger: hundreds of lines per model load.
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(
        str(gguf_path).encode(), llama_cpp.llama_model_default_params()
    )
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = parallel * max(r.prompt_len + r.output_len for r in requests)
    params.n_batch = batch_tokens
    params.n_seq_max = parallel
    # One cache stream per sequence: a cache shared by all (kv_unified) made W1 slower here
    # (65.6 against 78.1 output tokens/s, one run each).
    params.kv_unified = False
    params.n_threads = params.n_threads_batch = threads
    context = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(batch_tokens, 0, 1)
    vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    try:
        return _decode_all(requests, parallel, context, batch, batch_tokens, vocab_size)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(context)
        llama_cpp.llama_model_free(model)


@dataclass
class _Slot:
    request: BenchRequest
    tokens: list[int]  # prompt, then the outputs so far
    seq_id: int | None = None  # the sequence it runs on, once seated
    token_times: list[float] = field(default_factory=list)
    prefilled: bool = False

    @property
    def done(self) -> bool:
        return len(self.token_times) == self.request.output_len


def _decode_all(
    requests: list[BenchRequest], parallel: int, context, batch, batch_tokens: int, vocab_size: int
) -> OfflineRun:
    import llama_cpp

    slots = [_Slot(r, list(r.prompt_token_ids)) for r in requests]
    waiting, free_seq_ids, seated = deque(slots), list(range(parallel)), []
    memory = llama_cpp.llama_get_memory(context)
    started = time.perf_counter()
    while waiting or seated:
        while waiting and free_seq_ids:
            waiting[0].seq_id = free_seq_ids.pop()
            seated.append(waiting.popleft())
        # Decodes first, then whole prompts while they fit, as llama-server fills its batch.
        stepping = [slot for slot in seated if slot.prefilled]
        budget = batch_tokens - len(stepping)
        for slot in seated:
            if not slot.prefilled and slot.request.prompt_len <= budget:
                stepping.append(slot)
                budget -= slot.request.prompt_len
        batch.n_tokens = 0
        logit_entries = []
        for slot in stepping:
            new = slot.tokens[-1:] if slot.prefilled else slot.tokens
            logit_entries.append(_add_tokens(batch, new, len(slot.tokens) - len(new), slot.seq_id))
        if llama_cpp.llama_decode(context, batch) != 0:
            raise RuntimeError("llama_decode failed")
        now = time.perf_counter() - started
        for slot, entry in zip(stepping, logit_entries, strict=True):
            logits = llama_cpp.llama_get_logits_ith(context, entry)
            slot.tokens.append(int(np.ctypeslib.as_array(logits, (vocab_size,)).argmax()))
            slot.token_times.append(now)
            slot.prefilled = True
            if slot.done:
                llama_cpp.llama_memory_seq_rm(memory, slot.seq_id, -1, -1)
                free_seq_ids.append(slot.seq_id)
                seated.remove(slot)
    token_times = [slot.token_times for slot in slots]
    return _timed_run(requests, token_times, time.perf_counter() - started, batch_size=parallel)


def _timed_run(
    requests: list[BenchRequest], token_times: list[list[float]], duration: float, batch_size: int
) -> OfflineRun:
    """The run, from each request's token times (seconds from the start): TTFT at its first
    token, E2E at its last, TPOT over the tokens after the first."""
    return OfflineRun(
        name=NAME,
        batch_size=batch_size,
        duration_s=duration,
        prompt_tokens=sum(r.prompt_len for r in requests),
        output_tokens=sum(r.output_len for r in requests),
        e2e_s=[times[-1] for times in token_times],
        ttft_s=[times[0] for times in token_times],
        tpot_s=[
            (times[-1] - times[0]) / (len(times) - 1) for times in token_times if len(times) > 1
        ],
    )


def _add_tokens(batch, tokens: list[int], first_position: int, seq_id: int) -> int:
    """Appends a sequence's tokens to the batch, asking logits for its last one only; returns
    that token's entry in the batch."""
    for offset, token in enumerate(tokens):
        entry = batch.n_tokens + offset
        batch.token[entry] = token
        batch.pos[entry] = first_position + offset
        batch.n_seq_id[entry] = 1
        batch.seq_id[entry][0] = seq_id
        batch.logits[entry] = offset == len(tokens) - 1
    batch.n_tokens += len(tokens)
    return batch.n_tokens - 1
