"""Two seats; A wants 8 tokens, B 64, C waits: continuous against request-level batching."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams

PROMPTS = {"A": [11, 12, 13, 14], "B": [21, 22, 23, 24, 25, 26], "C": [31, 32, 33]}
MAX_TOKENS = {"A": 8, "B": 64, "C": 8}


def _run(checkpoint, policy: str) -> dict:
    llm = LLM(str(checkpoint), dtype="float32", max_num_seqs=2, scheduler=policy)
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS[name], ignore_eos=True)
        for name in PROMPTS
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS.values()], params)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    return dict(zip(PROMPTS, outputs, strict=True))


@pytest.fixture(scope="module")
def runs(tiny_checkpoint) -> dict:
    checkpoint = tiny_checkpoint("llama")
    return {policy: _run(checkpoint, policy) for policy in ("continuous", "static")}


def test_continuous_releases_a_and_admits_c_at_the_next_step(runs):
    a, b, c = (runs["continuous"][name].metrics for name in "ABC")
    # Step 0 prefills A and B and yields their first tokens; 7 decode steps finish A.
    assert a.first_token_step == 0 and a.finished_step == 7
    assert c.first_token_step == a.finished_step + 1
    assert b.finished_step == 63  # one token every step: C's arrival never stalled B
    assert a.finished_time < c.first_token_time < b.finished_time


def test_static_releases_a_with_b_and_starts_c_after_both(runs):
    a, b, c = (runs["static"][name].metrics for name in "ABC")
    assert a.finished_step == b.finished_step == 63
    assert a.finished_time == b.finished_time
    assert c.first_token_step == b.finished_step + 1
    assert c.first_scheduled_time > b.finished_time


def test_policies_produce_the_same_tokens(runs):
    for name in PROMPTS:
        continuous = runs["continuous"][name].outputs[0]
        static = runs["static"][name].outputs[0]
        assert continuous.token_ids == static.token_ids
        assert len(continuous.token_ids) == MAX_TOKENS[name]
        assert continuous.finish_reason == static.finish_reason == "length"
