"""What prefix caching buys: requests sharing a long system prompt, with the cache on and off.

32 requests share a 512-token system prompt and differ in a 32-token suffix; each generates 64
tokens (greedy, end-of-sequence ignored) and all arrive at once. Both runs go in-process through
`LLMEngine` with the same settings but `enable_prefix_caching`, one after the other in one
process, so the figures compare like with like.
"""

from __future__ import annotations

import gc
import random
import time

import numpy as np

from pagedserve.bench.records import PrefixCaching, PrefixCachingRun
from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

NUM_REQUESTS = 32
SYSTEM_PROMPT_TOKENS = 512
SUFFIX_TOKENS = 32
OUTPUT_TOKENS = 64


def build_prompts(engine: LLMEngine, seed: int = 0) -> list[list[int]]:
    """The workload's prompts as token ids: ordinary tokens drawn at random, one shared system
    prompt, then a distinct suffix per request."""
    special = set(engine.tokenizer.all_special_ids)
    ordinary = [t for t in range(min(engine.vocab_size, len(engine.tokenizer))) if t not in special]
    rng = random.Random(seed)
    system = rng.choices(ordinary, k=SYSTEM_PROMPT_TOKENS)
    return [system + rng.choices(ordinary, k=SUFFIX_TOKENS) for _ in range(NUM_REQUESTS)]


def run_prefix_caching_benchmark(model: str | None = None, **engine_args) -> PrefixCaching:
    """Runs the workload with caching on, then off, with the same settings otherwise."""
    prompts: list[list[int]] | None = None
    runs = {}
    for caching in (True, False):
        config = EngineConfig(model=model, enable_prefix_caching=caching, **engine_args)
        engine = LLMEngine(config)
        prompts = prompts or build_prompts(engine)
        runs["on" if caching else "off"] = _measure(engine, prompts)
        del engine  # its KV cache goes before the next one is allocated
        gc.collect()
    return PrefixCaching(
        num_requests=NUM_REQUESTS,
        system_prompt_tokens=SYSTEM_PROMPT_TOKENS,
        suffix_tokens=SUFFIX_TOKENS,
        output_tokens=OUTPUT_TOKENS,
        **runs,
    )


def _measure(engine: LLMEngine, prompts: list[list[int]]) -> PrefixCachingRun:
    _warm_up(engine)
    stats, bm = engine.stats, engine.block_manager
    queries, hits, steps = stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_steps
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    seqs = [engine.make_sequence({"prompt_token_ids": p}, params) for p in prompts]
    started = time.monotonic()
    for seq in seqs:
        engine.submit(seq)
    results: list[RequestOutput] = []
    peak_blocks = 0
    while engine.has_unfinished_requests():
        results += [out.final for out in engine.step() if out.final is not None]
        peak_blocks = max(peak_blocks, bm.num_blocks - bm.num_free_blocks)
    duration = time.monotonic() - started
    ttft = [r.metrics.first_token_time - r.metrics.arrival_time for r in results]
    queried = stats.prefix_cache_queries - queries
    return PrefixCachingRun(
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        output_tokens_per_s=sum(len(r.outputs[0].token_ids) for r in results) / duration,
        peak_kv_blocks=peak_blocks,
        prefix_cache_hit_rate=(stats.prefix_cache_hits - hits) / queried if queried else None,
        duration_s=duration,
        num_steps=stats.num_steps - steps,
        num_preemptions=engine.scheduler.num_preemptions,
    )


def _warm_up(engine: LLMEngine) -> None:
    """One short request first, so that one-time costs of the first forward count in neither."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request({"prompt_token_ids": list(range(100, 164))}, params)
    while engine.has_unfinished_requests():
        engine.step()
