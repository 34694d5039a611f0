"""Prefix caching and parallel sampling change no output: the engine on tiny models with the
cache on and off, against transformers, and n samples against n single requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import reference_greedy
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.engine.sequence import sample_seed

BLOCK = 8
NEW_TOKENS = 24


def _base(length: int = 40, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(3, 49152, length).tolist()


BASE = _base()
# Shared prefixes of several lengths: inside the first block, ending exactly on a block
# boundary, a few blocks, the whole base; then full hits, aligned and not.
PROMPTS = [
    BASE,
    [*BASE[:3], 11, 12, 13, 14, 15],
    [*BASE[:16], 21, 22, 23],
    BASE[:20] + [31] * 9,
    [*BASE, 41, 42],
    BASE,
    BASE[:16],
    BASE[:17],
]


def _llm(checkpoint, caching: bool, **engine_args) -> LLM:
    # A small cache loads in a blink; 512 blocks never fill in these tests unless asked to.
    engine_args = {"num_kv_blocks": 512, **engine_args}
    return LLM(
        str(checkpoint),
        dtype="float32",
        block_size=BLOCK,
        enable_prefix_caching=caching,
        **engine_args,
    )


def _token_ids(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [out.outputs[0].token_ids for out in outputs]


def _greedy(max_tokens: int = NEW_TOKENS, **fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **fields)


def _cached_tokens(prompt: list[int]) -> int:
    """What a warm cache gives a prompt: its full blocks, short of the last token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def _assert_nothing_held(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert bm.num_shared_blocks == 0


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def references(checkpoint) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return [reference_greedy(model, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("architecture", ["llama", "mistral"])
def test_greedy_outputs_are_the_same_with_caching_on_and_off(architecture, tiny_checkpoint):
    checkpoint = tiny_checkpoint(architecture)
    off = _token_ids(_llm(checkpoint, caching=False), PROMPTS, _greedy())
    llm = _llm(checkpoint, caching=True)
    # All at once: later prompts take blocks the first computes in the same step.
    assert _token_ids(llm, PROMPTS, _greedy()) == off
    stats = llm.engine.stats
    assert stats.prefix_cache_queries == sum(len(p) for p in PROMPTS)
    assert stats.prefix_cache_hits > 0
    # Again, on a warm cache: every prompt finds all its full blocks but the last token's.
    hits_before = stats.prefix_cache_hits
    assert _token_ids(llm, PROMPTS, _greedy()) == off
    assert stats.prefix_cache_hits - hits_before == sum(_cached_tokens(p) for p in PROMPTS)
    _assert_nothing_held(llm)


def test_cached_outputs_match_transformers(checkpoint, references):
    llm = _llm(checkpoint, caching=True)
    for _ in range(2):
        assert _token_ids(llm, PROMPTS, _greedy()) == references


def test_seeded_sampling_is_the_same_with_caching_on_and_off(checkpoint):
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=8, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    off = _token_ids(_llm(checkpoint, caching=False), PROMPTS, params)
    llm = _llm(checkpoint, caching=True)
    assert _token_ids(llm, PROMPTS, params) == off
    assert _token_ids(llm, PROMPTS, params) == off
    assert llm.engine.stats.prefix_cache_hits > 0


def test_a_hit_after_eviction_and_recompute_changes_nothing(checkpoint):
    # 24 blocks of 8: the long request below must evict most of what the first one cached.
    llm = _llm(checkpoint, caching=True, num_kv_blocks=24)
    stats = llm.engine.stats
    prompt, other = BASE, _base(150, seed=5)
    (expected,) = _token_ids(_llm(checkpoint, caching=False), [prompt], _greedy(20))
    assert _token_ids(llm, [prompt], _greedy(20)) == [expected]
    assert stats.prefix_cache_hits == 0
    _token_ids(llm, [other], _greedy(30))
    hits = []
    for _ in range(2):
        before = stats.prefix_cache_hits
        assert _token_ids(llm, [prompt], _greedy(20)) == [expected]
        hits.append(stats.prefix_cache_hits - before)
    # The least recently used went first, the tail before the head: one block survived; the
    # recompute cached the rest again.
    assert hits == [BLOCK, _cached_tokens(prompt)]
    _assert_nothing_held(llm)


def test_preemption_with_shared_prefixes_changes_nothing(checkpoint):
    prompts = [BASE[: 10 + 6 * i] + [100 + i] * 3 for i in range(6)]
    cramped = {"num_kv_blocks": 16, "max_num_batched_tokens": 48}
    off = _llm(checkpoint, caching=False, **cramped)
    on = _llm(checkpoint, caching=True, **cramped)
    expected = _token_ids(off, prompts, _greedy(30))
    assert _token_ids(on, prompts, _greedy(30)) == expected
    assert on.engine.scheduler.num_preemptions > 0
    assert on.engine.stats.prefix_cache_hits > 0
    _assert_nothing_held(on)


def test_abort_releases_shared_blocks(checkpoint):
    llm = _llm(checkpoint, caching=True)
    engine = llm.engine
    ids = [engine.add_request([*BASE, i], _greedy(60)) for i in range(3)]
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_shared_blocks == len(BASE) // BLOCK
    for request_id in ids[:2]:
        assert engine.abort_request(request_id)
    assert engine.block_manager.num_shared_blocks == 0
    while engine.has_unfinished_requests():
        engine.step()
    _assert_nothing_held(llm)


def test_caching_off_caches_nothing(checkpoint):
    llm = _llm(checkpoint, caching=False)
    _token_ids(llm, PROMPTS, _greedy(4))
    assert llm.engine.block_manager.num_cached_blocks == 0
    assert llm.engine.stats.prefix_cache_queries == llm.engine.stats.prefix_cache_hits == 0


# Parallel sampling.


def test_n_greedy_samples_equal_the_single_greedy_output(checkpoint):
    llm = _llm(checkpoint, caching=True)
    (single,) = _token_ids(llm, [BASE], _greedy())
    (result,) = llm.generate({"prompt_token_ids": BASE}, _greedy(n=4))
    assert [out.index for out in result.outputs] == [0, 1, 2, 3]
    assert [out.token_ids for out in result.outputs] == [single] * 4
    assert all(out.finish_reason == "length" for out in result.outputs)


def test_seeded_samples_are_distinct_reproducible_and_finish_on_their_own(checkpoint):
    llm = _llm(checkpoint, caching=False)
    seed = 2024
    sampled = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    singles = [
        _token_ids(llm, [BASE], SamplingParams(seed=sample_seed(seed, i), **sampled))[0]
        for i in range(4)
    ]
    assert len({tuple(tokens) for tokens in singles}) == 4
    # A stop token that only sample 1 draws, at its third token.
    stop = singles[1][2]
    assert all(stop not in tokens for i, tokens in enumerate(singles) if i != 1)
    params = SamplingParams(n=4, seed=seed, stop_token_ids=[stop], **sampled)
    (result,) = llm.generate({"prompt_token_ids": BASE}, params)
    outputs = result.outputs
    assert [out.token_ids for out in outputs] == [singles[0], singles[1][:3], *singles[2:]]
    assert [out.finish_reason for out in outputs] == ["length", "stop", "length", "length"]
    assert outputs[1].stop_reason == stop
    (again,) = llm.generate({"prompt_token_ids": BASE}, params)
    assert [out.token_ids for out in again.outputs] == [out.token_ids for out in outputs]


def test_streamed_samples_say_which_they_are_and_the_result_comes_last(checkpoint):
    llm = _llm(checkpoint, caching=True)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, logprobs=1)
    pieces = list(llm.engine.stream({"prompt_token_ids": BASE}, params))
    final = pieces[-1].final
    assert final is not None and all(piece.final is None for piece in pieces[:-1])
    for out in final.outputs:
        mine = [piece for piece in pieces if piece.index == out.index]
        assert [t for piece in mine for t in piece.new_token_ids] == out.token_ids
        assert "".join(piece.new_text for piece in mine) == out.text
        assert [lp for piece in mine for lp in piece.new_logprobs] == out.logprobs
        assert [piece.finish_reason for piece in mine if piece.finish_reason] == [out.finish_reason]


def test_four_samples_hold_the_prompts_full_blocks_once(checkpoint):
    llm = _llm(checkpoint, caching=True)
    engine = llm.engine
    bm = engine.block_manager
    prompt = [*BASE, 7, 8, 9]  # 5 full blocks and 3 tokens
    engine.add_request({"prompt_token_ids": prompt}, _greedy(30, n=4))
    engine.step()  # the prompt, then the fork
    samples = list(engine.scheduler.running)
    assert len(samples) == 4
    full = samples[0].block_table[:5]
    assert all(s.block_table[:5] == full for s in samples)
    assert [bm.blocks[b].ref_count for b in full] == [4] * 5
    engine.step()  # the partly filled block is copied for all but its last holder
    held = {b for s in samples for b in s.block_table}
    assert len(held) == 5 + 4
    assert bm.num_blocks - bm.num_free_blocks == len(held)
    while engine.has_unfinished_requests():
        engine.step()
    _assert_nothing_held(llm)


def test_aborting_n_samples_frees_every_block(checkpoint):
    llm = _llm(checkpoint, caching=True)
    engine = llm.engine
    request_id = engine.add_request({"prompt_token_ids": BASE}, _greedy(50, n=3))
    for _ in range(4):
        engine.step()
    assert engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()
    _assert_nothing_held(llm)


def test_n_above_max_num_seqs_is_refused(checkpoint):
    llm = _llm(checkpoint, caching=True, max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate({"prompt_token_ids": BASE}, _greedy(n=3))


def test_benchmark_runs_both_ways(checkpoint, monkeypatch):
    from pagedserve.bench import prefix_caching as bench

    for name, value in [("NUM_REQUESTS", 4), ("SYSTEM_PROMPT_TOKENS", 48), ("SUFFIX_TOKENS", 8)]:
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench, "OUTPUT_TOKENS", 4)
    results = bench.run_prefix_caching_benchmark(str(checkpoint), dtype="float32")
    on, off = results.on, results.off
    # Three of four requests find the 48 shared tokens (three blocks of 16).
    assert on.prefix_cache_hit_rate == pytest.approx(3 * 48 / (4 * 56))
    assert off.prefix_cache_hit_rate is None
    # Shared: 3 blocks plus 1 of each request's own; apart: 4 each.
    assert (on.peak_kv_blocks, off.peak_kv_blocks) == (3 + 4, 4 * 4)
    assert on.ttft_p50_s > 0 and off.output_tokens_per_s > 0
    assert results.num_requests == 4 and results.system_prompt_tokens == 48
