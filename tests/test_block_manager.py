"""Block accounting of the paged KV cache, on real sequences and a real scheduler (no model)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scheduling_fakes import FAKE_TOKEN, fake_model_step, make_scheduler, make_seq

import pagedserve
from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.scheduler import ScheduledBatch, Scheduler
from pagedserve.engine.sequence import Sequence, SequenceStatus


def finish_done(scheduler: Scheduler, sampled: list[Sequence]) -> None:
    for seq in sampled:
        if seq.num_output_tokens >= seq.max_tokens:
            scheduler.finish(seq, "length")


def assert_blocks_match_tokens(scheduler: Scheduler, batch: ScheduledBatch) -> None:
    """Right after schedule(): every sequence holds ceil(tokens it will have in cache / size)."""
    bm = scheduler.block_manager
    scheduled = {id(seq): num_new for seq, num_new in batch.entries}
    held: list[int] = []
    for seq in scheduler.running:
        tokens = seq.num_computed_tokens + scheduled.get(id(seq), 0)
        assert len(seq.block_table) == math.ceil(tokens / bm.block_size)
        held += seq.block_table
    for seq in scheduler.waiting:
        assert seq.block_table == []
        assert seq.num_computed_tokens == 0
    assert len(held) == len(set(held))  # no block in two tables
    assert len(held) + bm.num_free_blocks == bm.num_blocks
    assert all(bm.blocks[block_id].ref_count == 1 for block_id in held)
    assert sum(block.ref_count for block in bm.blocks) == len(held)


def run_until_done(scheduler: Scheduler, max_steps: int = 500, check: bool = True) -> int:
    steps = 0
    while scheduler.has_unfinished():
        assert steps < max_steps, "the scheduler did not drain (deadlock or lost request)"
        batch = scheduler.schedule()
        if check:
            assert_blocks_match_tokens(scheduler, batch)
        finish_done(scheduler, fake_model_step(batch))
        steps += 1
    return steps


# BlockManager on its own.


def test_zero_blocks_is_rejected():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, 4)


def test_capacity_and_blocks_for_round_up():
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.capacity_tokens == 20
    assert [bm.blocks_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("prompt_len", [1, 3, 4, 5, 8, 9, 16])
def test_prompt_takes_ceil_of_length_over_block_size(prompt_len):
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", prompt_len)
    assert bm.allocate(seq, prompt_len) is True
    assert len(seq.block_table) == math.ceil(prompt_len / 4)
    assert bm.num_free_blocks == 8 - math.ceil(prompt_len / 4)


def test_no_blocks_reserved_for_max_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", prompt_len=3, max_tokens=25)
    assert bm.allocate(seq, 3) is True
    assert len(seq.block_table) == 1
    assert bm.num_free_blocks == 7


def test_decode_takes_a_new_block_only_when_the_last_is_full():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", prompt_len=3)
    bm.allocate(seq, 3)
    seq.num_computed_tokens = 3
    counts = []
    for _ in range(7):  # decode tokens 4..10: block 2 at token 5, block 3 at token 9
        seq.token_ids.append(FAKE_TOKEN)
        assert bm.allocate(seq, 1) is True
        seq.num_computed_tokens += 1
        counts.append(len(seq.block_table))
    assert counts == [1, 2, 2, 2, 2, 3, 3]
    assert bm.num_free_blocks == 5


def test_chunks_grow_the_table_to_the_tokens_computed_so_far():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", prompt_len=14)
    counts = []
    for chunk in (5, 5, 4):
        assert bm.allocate(seq, chunk) is True
        seq.num_computed_tokens += chunk
        counts.append(len(seq.block_table))
    assert counts == [2, 3, 4]


def test_allocate_with_short_pool_returns_false_and_takes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    a, b = make_seq("a", 4), make_seq("b", 8)
    assert bm.allocate(a, 4) is True
    assert bm.allocate(b, 8) is False
    assert b.block_table == []
    assert bm.num_free_blocks == 1
    assert [block.ref_count for block in bm.blocks] == [1, 0]


def test_failed_growth_leaves_existing_table_untouched():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq("a", 12)
    assert bm.allocate(seq, 4) is True
    seq.num_computed_tokens = 4
    table = list(seq.block_table)
    assert bm.allocate(seq, 8) is False  # needs 2 more, 1 free
    assert seq.block_table == table
    assert bm.num_free_blocks == 1


def test_allocate_can_take_the_very_last_block():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq("a", 12)
    assert bm.allocate(seq, 12) is True
    assert bm.num_free_blocks == 0
    assert sorted(seq.block_table) == [0, 1, 2]


def test_free_returns_every_block_at_once_and_resets_computed_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", 10)
    bm.allocate(seq, 10)
    seq.num_computed_tokens = 10
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8
    assert seq.block_table == []
    assert seq.num_computed_tokens == 0


def test_ref_counts_are_one_while_held_and_zero_after_free():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = make_seq("a", 5), make_seq("b", 9)
    bm.allocate(a, 5)
    bm.allocate(b, 9)
    assert set(a.block_table).isdisjoint(b.block_table)
    held = a.block_table + b.block_table
    assert [bm.blocks[i].ref_count for i in held] == [1] * 5
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in held] == [0, 0, 1, 1, 1]
    bm.free(b)
    assert [block.ref_count for block in bm.blocks] == [0] * 6


def test_freed_blocks_can_be_taken_again():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = make_seq("a", 12), make_seq("b", 12)
    bm.allocate(a, 12)
    assert bm.allocate(b, 1) is False
    bm.free(a)
    assert bm.allocate(b, 12) is True
    assert sorted(b.block_table) == [0, 1, 2]


def test_usage_is_the_fraction_of_blocks_held():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.usage == 0.0
    a, b = make_seq("a", 12), make_seq("b", 20)
    bm.allocate(a, 12)
    assert bm.usage == pytest.approx(3 / 8)
    bm.allocate(b, 20)
    assert bm.usage == 1.0
    bm.free(a)
    assert bm.usage == pytest.approx(5 / 8)


# Blocks through the scheduler.


def test_scheduled_sequences_hold_blocks_for_computed_plus_scheduled_tokens():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=6)
    for request_id, prompt_len in (("a", 9), ("b", 3), ("c", 5)):
        scheduler.add(make_seq(request_id, prompt_len))
    batch = scheduler.schedule()
    assert [(seq.request_id, n) for seq, n in batch.entries] == [("a", 6)]
    assert len(batch.entries[0][0].block_table) == 2
    assert_blocks_match_tokens(scheduler, batch)


def test_all_blocks_free_after_every_request_finishes():
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=3, max_num_batched_tokens=8)
    for i, prompt_len in enumerate((3, 9, 4, 12, 1)):
        scheduler.add(make_seq(f"r{i}", prompt_len, max_tokens=5))
    run_until_done(scheduler)
    assert scheduler.block_manager.num_free_blocks == 16
    assert scheduler.num_preemptions == 0


def test_all_blocks_free_after_aborts_in_every_state():
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=8)
    decoding, prefilling, waiting = make_seq("a", 3), make_seq("b", 20), make_seq("c", 4)
    for seq in (decoding, prefilling, waiting):
        scheduler.add(seq)
    fake_model_step(scheduler.schedule())  # a: full prompt; b: first chunk of 5
    batch = scheduler.schedule()
    assert [(s.request_id, n) for s, n in batch.entries] == [("a", 1), ("b", 7)]
    fake_model_step(batch)
    assert scheduler.block_manager.num_free_blocks == 16 - 1 - 3
    assert scheduler.finish(waiting, "abort") == [waiting]
    assert scheduler.finish(prefilling, "abort") == [prefilling]
    assert scheduler.finish(decoding, "abort") == [decoding]
    assert scheduler.block_manager.num_free_blocks == 16
    assert not scheduler.has_unfinished()
    assert [s.finish_reason for s in (decoding, prefilling, waiting)] == ["abort"] * 3
    assert all(s.status is SequenceStatus.FINISHED for s in (decoding, prefilling, waiting))


def test_preempted_sequence_holds_no_blocks_and_all_are_free_after_it_finishes():
    scheduler = make_scheduler(num_blocks=3)
    seqs = [make_seq("a", 4), make_seq("b", 2), make_seq("c", 4)]
    for seq in seqs:
        scheduler.add(seq)
    fake_model_step(scheduler.schedule())
    batch = scheduler.schedule()  # a needs a second block: c, admitted last, is preempted
    assert batch.preempted == [seqs[2]]
    assert seqs[2].block_table == []
    assert seqs[2].num_computed_tokens == 0
    assert_blocks_match_tokens(scheduler, batch)
    finish_done(scheduler, fake_model_step(batch))
    run_until_done(scheduler)
    assert scheduler.block_manager.num_free_blocks == 3
    assert all(seq.num_output_tokens == 4 for seq in seqs)


def test_abort_of_a_preempted_sequence_leaves_every_block_free():
    scheduler = make_scheduler(num_blocks=3)
    seqs = [make_seq("a", 4), make_seq("b", 2), make_seq("c", 4)]
    for seq in seqs:
        scheduler.add(seq)
    fake_model_step(scheduler.schedule())
    fake_model_step(scheduler.schedule())
    assert list(scheduler.waiting) == [seqs[2]]
    assert scheduler.finish(seqs[2], "abort") == [seqs[2]]
    for seq in seqs[:2]:
        scheduler.finish(seq, "length")
    assert scheduler.block_manager.num_free_blocks == 3


@pytest.mark.parametrize("chunked", [True, False])
def test_block_accounting_holds_every_step_under_heavy_preemption(chunked):
    scheduler = make_scheduler(
        num_blocks=8, max_num_seqs=6, max_num_batched_tokens=16 if chunked else 40, chunked=chunked
    )
    for i in range(10):
        scheduler.add(make_seq(f"r{i}", prompt_len=3 + (5 * i) % 11, max_tokens=4 + i % 5))
    run_until_done(scheduler)  # checks blocks == ceil(tokens / size) after every schedule()
    assert scheduler.num_preemptions > 0
    assert scheduler.block_manager.num_free_blocks == 8


def test_request_filling_the_whole_cache_completes():
    # 2 blocks of 4 hold 8 tokens; the last sampled token is never written, so 3 + 6 fits.
    scheduler = make_scheduler(num_blocks=2)
    seq = make_seq("a", prompt_len=3, max_tokens=6)
    scheduler.add(seq)
    run_until_done(scheduler)
    assert seq.num_output_tokens == 6
    assert scheduler.block_manager.num_free_blocks == 2


def test_importing_scheduler_and_block_manager_does_not_import_torch():
    code = (
        "import sys\n"
        "import pagedserve.engine.scheduler, pagedserve.engine.block_manager\n"
        "print('torch' in sys.modules)\n"
    )
    src = str(Path(pagedserve.__file__).resolve().parents[1])  # this checkout's sources
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=120,
    )
    assert result.stdout.strip() == "False"


def test_block_states_name_every_block_free_used_shared_or_cached():
    bm = BlockManager(num_blocks=6, block_size=4, enable_caching=True)
    assert bm.block_states() == "ffffff"
    first = make_seq("a", 9)  # two full blocks (cached once written) and one partly filled
    assert bm.allocate(first, 9) is True
    fork = make_seq("b", 9)
    fork.block_table = list(first.block_table)
    bm.share(fork)
    states = bm.block_states()
    assert [states[b] for b in first.block_table] == ["s", "s", "s"]
    bm.free(fork)
    states = bm.block_states()
    assert [states[b] for b in first.block_table] == ["u", "u", "u"]
    table = list(first.block_table)
    bm.free(first)
    states = bm.block_states()
    # The full blocks stay findable by their keys; the partly filled one is simply free.
    assert [states[b] for b in table] == ["c", "c", "f"]
    assert sorted(states) == ["c", "c", "f", "f", "f", "f"]
