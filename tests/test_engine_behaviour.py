"""Streaming, abort, stop conditions, seeds and metrics of the engine on a tiny model."""

from __future__ import annotations

import time

import pytest

from pagedserve import LLM, SamplingParams

PROMPT = [101, 202, 303, 404, 505, 606, 707]
OTHER_PROMPTS = [[7, 8, 9], [1000, 2000, 3000, 4000, 5000], [42] * 30]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(str(tiny_checkpoint("qwen2")), dtype="float32")


@pytest.fixture(scope="module")
def greedy_run(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return llm.generate([PROMPT], params)[0].outputs[0]


def _stream(llm: LLM, prompt, params: SamplingParams):
    pieces, token_ids, final = [], [], None
    for output in llm.engine.stream(prompt, params):
        pieces.append(output.new_text)
        token_ids += output.new_token_ids
        final = output.final
    return "".join(pieces), token_ids, final


def test_a_stream_closed_early_aborts_its_request(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    stream = llm.engine.stream(PROMPT, params)
    next(stream)
    assert llm.engine.has_unfinished_requests()
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_streamed_pieces_add_up_to_the_final_output(llm, greedy_run):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text, token_ids, final = _stream(llm, PROMPT, params)
    assert token_ids == final.outputs[0].token_ids == greedy_run.token_ids
    assert text == final.outputs[0].text == greedy_run.text
    assert text == llm.get_tokenizer().decode(token_ids, skip_special_tokens=True)


def test_stop_string_ends_the_output_and_is_never_streamed(llm, greedy_run):
    stop = greedy_run.text[12:16]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    text, _, final = _stream(llm, PROMPT, params)
    expected = greedy_run.text[: greedy_run.text.find(stop)]
    assert text == final.outputs[0].text == expected
    assert final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].stop_reason == stop


def test_stop_token_id_ends_the_output(llm, greedy_run):
    stop_token = greedy_run.token_ids[5]
    first = greedy_run.token_ids.index(stop_token)
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token]
    )
    output = llm.generate([PROMPT], params)[0].outputs[0]
    assert output.token_ids == greedy_run.token_ids[: first + 1]
    assert (output.finish_reason, output.stop_reason) == ("stop", stop_token)


def test_min_tokens_bans_stop_tokens_until_reached(llm, greedy_run):
    stop_token = greedy_run.token_ids[2]
    params = SamplingParams(
        temperature=0, max_tokens=40, min_tokens=12, ignore_eos=True, stop_token_ids=[stop_token]
    )
    output = llm.generate([PROMPT], params)[0].outputs[0]
    assert stop_token not in output.token_ids[:12]
    assert len(output.token_ids) >= 12
    assert output.token_ids[:2] == greedy_run.token_ids[:2]


def test_max_tokens_finishes_with_length(llm):
    output = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(output[0].outputs[0].token_ids) == 3
    assert output[0].outputs[0].finish_reason == "length"


def test_seeded_sampling_is_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPT], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    batch = llm.generate([*OTHER_PROMPTS, PROMPT], [others] * 3 + [seeded])
    assert batch[-1].outputs[0].token_ids == alone
    reseeded = seeded.model_copy(update={"seed": 4321})
    assert llm.generate([PROMPT], reseeded)[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy(llm, greedy_run):
    params = SamplingParams(temperature=1.5, top_k=1, max_tokens=40, ignore_eos=True)
    assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == greedy_run.token_ids


def test_abort_frees_blocks_at_once_and_others_finish(llm):
    engine = llm.engine
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    victim = engine.add_request(PROMPT * 5, long)
    survivor = engine.add_request(OTHER_PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))
    for _ in range(3):
        engine.step()
    held_before = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    assert engine.abort_request(victim)
    held_after = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    assert held_after == held_before - 3  # 35 prompt + 3 new tokens fill 3 blocks of 16
    assert not engine.abort_request(victim)
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {out.request_id: out.final for out in engine.step() if out.finished}
    assert list(finished) == [survivor]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_metrics_are_ordered_on_one_clock(llm):
    output = llm.generate([PROMPT, *OTHER_PROMPTS], SamplingParams(max_tokens=5))[0]
    m = output.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.time_in_queue == m.first_scheduled_time - m.arrival_time >= 0
    assert m.first_token_step <= m.finished_step


def test_abort_under_static_releases_the_rest_of_the_batch(tiny_checkpoint):
    engine = LLM(str(tiny_checkpoint("llama")), dtype="float32", scheduler="static").engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    aborted = engine.add_request(PROMPT, params)
    kept = engine.add_request(OTHER_PROMPTS[1], params)
    engine.step()
    assert engine.abort_request(aborted)
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {out.request_id: out.final for out in engine.step() if out.finished}
    assert list(finished) == [kept]
    assert len(finished[kept].outputs[0].token_ids) == 6
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_step_timers_cover_every_phase(llm):
    timer = llm.engine.phase_timer
    before = dict(timer.seconds)
    started = time.perf_counter()
    llm.generate([PROMPT, *OTHER_PROMPTS], SamplingParams(max_tokens=6))
    elapsed = time.perf_counter() - started
    spent = {phase: timer.seconds[phase] - before.get(phase, 0.0) for phase in timer.seconds}
    assert set(spent) == {"schedule", "prepare", "forward", "sample", "output"}
    assert all(seconds > 0 for seconds in spent.values())
    assert sum(spent.values()) <= elapsed
