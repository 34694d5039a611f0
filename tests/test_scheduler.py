"""Iteration-level scheduling, driven by a fake model step on real sequences (no model)."""

from __future__ import annotations

import pytest
from scheduling_fakes import fake_model_step, make_scheduler, make_seq

from pagedserve.engine.scheduler import ScheduledBatch, Scheduler
from pagedserve.engine.sequence import Sequence, SequenceStatus


def add_all(scheduler: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        scheduler.add(seq)


def entries(batch: ScheduledBatch) -> list[tuple[str, int]]:
    return [(seq.request_id, num_new) for seq, num_new in batch.entries]


def ids(seqs) -> list[str]:
    return [seq.request_id for seq in seqs]


def step(scheduler: Scheduler) -> tuple[ScheduledBatch, list[Sequence]]:
    """One engine step: schedule, compute, finish whoever reached max_tokens; returns released."""
    batch = scheduler.schedule()
    released = []
    for seq in fake_model_step(batch):
        if seq.num_output_tokens >= seq.max_tokens:
            released += scheduler.finish(seq, "length")
    return batch, released


def run_until_done(scheduler: Scheduler, max_steps: int = 500) -> tuple[list[Sequence], int]:
    """Steps until nothing is left, checking the limits every step; returns (released, steps)."""
    config = scheduler.config
    released: list[Sequence] = []
    steps = 0
    while scheduler.has_unfinished():
        assert steps < max_steps, "the scheduler did not drain (deadlock or lost request)"
        batch, newly_released = step(scheduler)
        assert len(scheduler.running) <= config.max_num_seqs
        assert len(batch.entries) <= config.max_num_seqs
        assert batch.num_tokens <= config.max_num_batched_tokens
        released += newly_released
        steps += 1
    return released, steps


# Admission.


def test_admission_is_first_come_first_served():
    scheduler = make_scheduler(max_num_seqs=2)
    add_all(scheduler, make_seq("a", 3), make_seq("b", 5), make_seq("c", 2))
    batch = scheduler.schedule()
    assert entries(batch) == [("a", 3), ("b", 5)]
    assert ids(scheduler.running) == ["a", "b"]
    assert ids(scheduler.waiting) == ["c"]
    assert scheduler.running[0].status is SequenceStatus.RUNNING
    assert scheduler.waiting[0].status is SequenceStatus.WAITING


def test_empty_scheduler_gives_an_empty_batch():
    scheduler = make_scheduler()
    batch = scheduler.schedule()
    assert not batch
    assert batch.entries == [] and batch.preempted == []
    assert not scheduler.has_unfinished()


def test_max_num_seqs_caps_the_running_set_every_step():
    scheduler = make_scheduler(max_num_seqs=3)
    add_all(scheduler, *(make_seq(f"r{i}", 2, max_tokens=2 + i) for i in range(7)))
    batch, _ = step(scheduler)
    assert entries(batch) == [("r0", 2), ("r1", 2), ("r2", 2)]
    released, _ = run_until_done(scheduler)  # asserts <= 3 running every step
    assert sorted(ids(released)) == [f"r{i}" for i in range(7)]


def test_token_budget_caps_each_step_without_chunking():
    scheduler = make_scheduler(max_num_batched_tokens=10, chunked=False)
    add_all(scheduler, make_seq("a", 4), make_seq("b", 5), make_seq("c", 3))
    batch = scheduler.schedule()
    assert entries(batch) == [("a", 4), ("b", 5)]  # c's 3 would make 12 > 10
    assert batch.num_tokens == 9
    assert ids(scheduler.waiting) == ["c"]


# Chunked prefill.


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq("a", 20)
    scheduler.add(seq)
    chunks, computed, outputs = [], [], []
    for _ in range(4):
        batch, _ = step(scheduler)
        chunks.append(entries(batch))
        computed.append(seq.num_computed_tokens)
        outputs.append(seq.num_output_tokens)
    assert chunks == [[("a", 8)], [("a", 8)], [("a", 4)], [("a", 1)]]
    assert computed == [8, 16, 20, 21]
    assert outputs == [0, 0, 1, 2]  # the first token comes only with the last chunk


def test_running_sequences_go_before_new_admissions():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(make_seq("a", 3))
    step(scheduler)
    scheduler.add(make_seq("b", 20))
    batch, _ = step(scheduler)
    assert entries(batch) == [("a", 1), ("b", 7)]


def test_unfinished_prefill_chunk_goes_before_a_newer_prompt():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(make_seq("a", 20))
    step(scheduler)
    scheduler.add(make_seq("b", 2))
    batch, _ = step(scheduler)
    assert entries(batch) == [("a", 8)]
    assert ids(scheduler.waiting) == ["b"]
    batch, _ = step(scheduler)
    assert entries(batch) == [("a", 4), ("b", 2)]


def test_without_chunking_a_prompt_over_the_remaining_budget_waits():
    scheduler = make_scheduler(max_num_batched_tokens=8, chunked=False)
    a = make_seq("a", 3, max_tokens=2)
    scheduler.add(a)
    step(scheduler)
    add_all(scheduler, make_seq("b", 8), make_seq("c", 1))
    batch, released = step(scheduler)  # 1 decode token + 8 > 8: b waits, and c behind it
    assert entries(batch) == [("a", 1)]
    assert ids(scheduler.waiting) == ["b", "c"]
    assert released == [a]
    batch, _ = step(scheduler)
    assert entries(batch) == [("b", 8)]


def test_without_chunking_a_prompt_over_the_whole_budget_never_runs():
    scheduler = make_scheduler(max_num_batched_tokens=8, chunked=False)
    scheduler.add(make_seq("a", 9))
    for _ in range(3):
        assert entries(scheduler.schedule()) == []
    assert ids(scheduler.waiting) == ["a"]
    assert scheduler.block_manager.num_free_blocks == 64


# Mixed steps and seats.


def test_one_step_holds_decodes_and_prefills():
    scheduler = make_scheduler()
    add_all(scheduler, make_seq("a", 3), make_seq("b", 6))
    step(scheduler)
    add_all(scheduler, make_seq("c", 5))
    batch, _ = step(scheduler)
    assert entries(batch) == [("a", 1), ("b", 1), ("c", 5)]


def test_finished_sequence_seat_is_filled_at_the_next_schedule():
    scheduler = make_scheduler(max_num_seqs=2)
    a, b, c = make_seq("a", 2, max_tokens=1), make_seq("b", 2, max_tokens=5), make_seq("c", 4)
    add_all(scheduler, a, b, c)
    batch, released = step(scheduler)
    assert entries(batch) == [("a", 2), ("b", 2)]
    assert released == [a]
    assert a.finish_reason == "length" and a.is_finished
    batch, _ = step(scheduler)
    assert entries(batch) == [("b", 1), ("c", 4)]


def test_finish_of_a_waiting_sequence_removes_it_from_the_queue():
    scheduler = make_scheduler(max_num_seqs=1)
    a, b, c = make_seq("a", 2), make_seq("b", 2), make_seq("c", 2)
    add_all(scheduler, a, b, c)
    scheduler.schedule()
    assert scheduler.finish(b, "abort") == [b]
    assert ids(scheduler.waiting) == ["c"]
    assert b.finish_reason == "abort"


# Preemption.


def preempting_scheduler(**kwargs) -> tuple[Scheduler, list[Sequence]]:
    """Three one-block prompts in a three-block cache; at the second schedule a needs a block."""
    scheduler = make_scheduler(num_blocks=3, **kwargs)
    seqs = [make_seq("a", 4), make_seq("b", 2), make_seq("c", 4)]
    add_all(scheduler, *seqs)
    step(scheduler)
    return scheduler, seqs


def test_the_sequence_admitted_last_is_preempted():
    scheduler, (a, b, c) = preempting_scheduler()
    batch = scheduler.schedule()
    assert batch.preempted == [c]
    assert batch.entries == [(a, 1), (b, 1)]
    assert scheduler.running == [a, b]
    assert scheduler.num_preemptions == 1


def test_preempted_sequence_loses_its_blocks_but_keeps_its_tokens():
    scheduler, (_, _, c) = preempting_scheduler()
    scheduler.schedule()
    assert c.status is SequenceStatus.WAITING
    assert c.block_table == []
    assert c.num_computed_tokens == 0
    assert c.num_tokens == 5  # prompt and its one sampled token, all to be recomputed


def test_preempted_sequence_goes_to_the_head_of_the_queue():
    scheduler, (_, _, c) = preempting_scheduler()
    d = make_seq("d", 1)
    scheduler.add(d)
    scheduler.schedule()
    assert list(scheduler.waiting) == [c, d]


def test_preemptions_are_counted_one_per_victim():
    scheduler = make_scheduler(num_blocks=4)
    seqs = [make_seq(name, 4) for name in "abcd"]
    add_all(scheduler, *seqs)
    step(scheduler)
    batch = scheduler.schedule()  # every one needs a second block: d, then c, give theirs up
    assert ids(batch.preempted) == ["d", "c"]
    assert entries(batch) == [("a", 1), ("b", 1)]
    assert ids(scheduler.waiting) == ["c", "d"]  # original order kept at the head
    assert scheduler.num_preemptions == 2


def test_no_admission_in_a_step_with_a_preemption():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=8)
    a, b = make_seq("a", 4), make_seq("b", 8)
    add_all(scheduler, a, b)
    step(scheduler)  # a: 4, b: first 4
    step(scheduler)  # a: 1 decode, b: last 4; all 4 blocks held
    batch = scheduler.schedule()  # b needs a third block and preempts itself
    assert batch.preempted == [b]
    assert entries(batch) == [("a", 1)]
    # 2 blocks and 7 budget tokens are free, enough for b's first chunk, yet b is not re-admitted.
    assert scheduler.block_manager.num_free_blocks == 2
    assert list(scheduler.waiting) == [b]
    fake_model_step(batch)
    assert entries(scheduler.schedule()) == [("a", 1), ("b", 7)]


def test_preempted_sequence_is_recomputed_whole_and_completes():
    scheduler, (a, b, c) = preempting_scheduler()
    released, _ = run_until_done(scheduler)
    assert sorted(ids(released)) == ["a", "b", "c"]
    assert [s.num_output_tokens for s in (a, b, c)] == [4, 4, 4]
    assert scheduler.num_preemptions >= 1
    assert scheduler.block_manager.num_free_blocks == 3


def test_recompute_schedules_prompt_and_generated_tokens_together():
    scheduler, (a, b, c) = preempting_scheduler()
    scheduler.schedule()
    scheduler.finish(a, "abort")
    scheduler.finish(b, "abort")
    batch = scheduler.schedule()
    assert batch.entries == [(c, 5)]


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_heavy_load_drains_with_every_request_complete(chunked, policy):
    scheduler = make_scheduler(
        num_blocks=8,
        max_num_seqs=5,
        max_num_batched_tokens=12 if chunked else 40,
        chunked=chunked,
        policy=policy,
    )
    seqs = [make_seq(f"r{i}", 2 + (7 * i) % 13, max_tokens=3 + i % 6) for i in range(12)]
    add_all(scheduler, *seqs)
    released, _ = run_until_done(scheduler, max_steps=1000)
    assert sorted(ids(released)) == sorted(ids(seqs))
    assert len(released) == 12
    assert all(s.num_output_tokens == s.max_tokens for s in seqs)
    assert all(s.finish_reason == "length" for s in seqs)
    assert scheduler.num_preemptions > 0
    assert scheduler.block_manager.num_free_blocks == 8
    assert not scheduler.running and not scheduler.waiting


# The static policy.


def static_scheduler(**kwargs) -> Scheduler:
    return make_scheduler(max_num_seqs=2, policy="static", **kwargs)


def test_static_batch_is_formed_from_the_head_of_the_queue():
    scheduler = static_scheduler()
    add_all(scheduler, make_seq("a", 3), make_seq("b", 2), make_seq("c", 2))
    batch = scheduler.schedule()
    assert entries(batch) == [("a", 3), ("b", 2)]
    assert ids(scheduler.waiting) == ["c"]


def test_static_nothing_joins_when_a_seat_frees_mid_batch():
    scheduler = static_scheduler()
    add_all(scheduler, make_seq("a", 2, 1), make_seq("b", 2, 3), make_seq("c", 2))
    step(scheduler)  # a is done
    batch, _ = step(scheduler)
    assert entries(batch) == [("b", 1)]
    assert ids(scheduler.running) == ["b"]
    assert ids(scheduler.waiting) == ["c"]


def test_static_finish_holds_members_until_the_whole_batch_is_done():
    scheduler = static_scheduler()
    a, b = make_seq("a", 2, 1), make_seq("b", 2, 3)
    add_all(scheduler, a, b, make_seq("c", 2))
    releases = [step(scheduler)[1] for _ in range(3)]
    assert releases == [[], [], [a, b]]
    assert a.is_finished and b.is_finished


def test_static_next_batch_starts_after_the_last_member_finishes():
    scheduler = static_scheduler()
    seqs = [make_seq("a", 2, 1), make_seq("b", 2, 3), make_seq("c", 2), make_seq("d", 3)]
    add_all(scheduler, *seqs)
    for _ in range(3):
        step(scheduler)
    batch = scheduler.schedule()
    assert entries(batch) == [("c", 2), ("d", 3)]


def test_static_abort_of_a_member_frees_its_blocks_at_once_and_the_batch_goes_on():
    scheduler = static_scheduler()
    a, b, c = make_seq("a", 2), make_seq("b", 2), make_seq("c", 2)
    add_all(scheduler, a, b, c)
    step(scheduler)
    scheduler.finish(a, "abort")
    assert a.is_finished and a.finish_reason == "abort"
    assert scheduler.block_manager.num_free_blocks == 63
    batch, _ = step(scheduler)
    assert entries(batch) == [("b", 1)]  # c does not take a's seat
    assert b in scheduler.finish(b, "length")


def test_static_drop_held_forgets_a_held_member():
    scheduler = static_scheduler()
    a, b = make_seq("a", 2, 1), make_seq("b", 2, 3)
    add_all(scheduler, a, b)
    step(scheduler)
    scheduler.drop_held(a)
    releases = [step(scheduler)[1] for _ in range(2)]
    assert releases == [[], [b]]


def test_static_preempted_member_rejoins_before_waiting_non_members():
    scheduler = make_scheduler(num_blocks=2, max_num_seqs=2, policy="static")
    a, b, c = make_seq("a", 4, 2), make_seq("b", 4, 2), make_seq("c", 1)
    add_all(scheduler, a, b, c)
    step(scheduler)
    batch = scheduler.schedule()  # a needs a second block: b is preempted
    assert batch.preempted == [b]
    assert ids(scheduler.waiting) == ["b", "c"]
    fake_model_step(batch)
    assert scheduler.finish(a, "length") == []
    batch = scheduler.schedule()
    assert entries(batch) == [("b", 5)]  # c, not in the batch, still waits with a seat free
    assert ids(scheduler.waiting) == ["c"]


def test_continuous_policy_releases_each_sequence_at_once():
    scheduler = make_scheduler(max_num_seqs=2)
    a, b = make_seq("a", 2, 1), make_seq("b", 2, 3)
    add_all(scheduler, a, b)
    releases = [step(scheduler)[1] for _ in range(3)]
    assert releases == [[a], [], [b]]
