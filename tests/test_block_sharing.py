"""Block sharing without a model: prefix-cache keys, reference counts, eviction order, copy on
write and forks, on real sequences and a real scheduler."""

from __future__ import annotations

from collections import Counter

import pytest

from pagedserve.engine.block_manager import BlockKey, BlockManager, CachedPrefix
from pagedserve.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from pagedserve.engine.sequence import Sequence
from pagedserve.outputs import RequestMetrics
from pagedserve.sampling_params import SamplingParams

SIZE = 4
FAKE_TOKEN = 7


def make_seq(request_id: str, prompt: list[int], max_tokens: int = 4, n: int = 1) -> Sequence:
    return Sequence(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens, n=n),
        seed=0,
        max_tokens=max_tokens,
        metrics=RequestMetrics(arrival_time=0.0),
        pending_forks=n - 1,
    )


def make_scheduler(num_blocks: int, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    block_manager = BlockManager(num_blocks, SIZE, enable_caching=True)
    return Scheduler(SchedulerConfig(max_num_seqs, budget), block_manager)


def admit(bm: BlockManager, seq: Sequence) -> CachedPrefix:
    """What the scheduler does on admission: take the cached prefix, allocate the rest."""
    prefix = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix)
    seq.num_computed_tokens = seq.num_tokens
    return prefix


def fake_step(scheduler: Scheduler, batch: ScheduledBatch) -> None:
    """Does what the engine does with a step; finishes sequences that reach max_tokens."""
    for seq, num_new in batch.entries:
        seq.num_computed_tokens += num_new
    samplers = [
        sampler
        for seq, _ in batch.entries
        if seq.num_computed_tokens == seq.num_tokens
        for sampler in (seq, *batch.forks.get(seq, ()))
    ]
    for seq in samplers:
        seq.token_ids.append(FAKE_TOKEN + seq.sample_index)
        if seq.num_output_tokens >= seq.max_tokens:
            scheduler.finish(seq, "length")


def check_accounting(scheduler: Scheduler) -> None:
    """Every block's reference count is the number of tables that hold it; the rest is free."""
    bm = scheduler.block_manager
    holders = Counter(b for seq in scheduler.running for b in seq.block_table)
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
    assert bm.num_free_blocks == bm.num_blocks - len(holders)
    assert bm.num_shared_blocks == sum(1 for count in holders.values() if count > 1)
    assert all(seq.block_table == [] for seq in scheduler.waiting)
    for key, block_id in bm._cached.items():
        assert bm.blocks[block_id].key is key


def check_partial_blocks_are_private(bm: BlockManager, batch: ScheduledBatch) -> None:
    """A partly filled block a step writes is held by its sequence alone, or with the forks made
    in that step, which are to see exactly those tokens. (Full blocks may be taken from the cache
    by others in the same step: that is the point.)"""
    for seq, num_new in batch.entries:
        end = seq.num_computed_tokens + num_new
        if end % SIZE:
            holders = 1 + len(batch.forks.get(seq, ()))
            assert bm.blocks[seq.block_table[end // SIZE]].ref_count == holders


def run_until_done(scheduler: Scheduler, max_steps: int = 500) -> Counter:
    """Steps until every sequence is done; returns the cache hits, forks and copies made."""
    seen: Counter = Counter()
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return seen
        batch = scheduler.schedule()
        check_partial_blocks_are_private(scheduler.block_manager, batch)
        seen.update(hits=batch.prefix_hit_tokens, forks=len(batch.forks))
        seen.update(copies=len(batch.block_copies))
        fake_step(scheduler, batch)
        check_accounting(scheduler)
    raise AssertionError("the scheduler did not drain")


def assert_nothing_held(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert bm.num_shared_blocks == 0


# Keys.


def test_key_equality_covers_every_token_before_the_block():
    root_a, root_b = BlockKey(None, (1, 2)), BlockKey(None, (1, 3))
    assert BlockKey(root_a, (5, 6)) == BlockKey(BlockKey(None, (1, 2)), (5, 6))
    assert BlockKey(root_a, (5, 6)) != BlockKey(root_b, (5, 6))
    assert hash(BlockKey(root_a, (5, 6))) == hash(BlockKey(BlockKey(None, (1, 2)), (5, 6)))


def test_colliding_hashes_never_make_keys_equal():
    a, b = BlockKey(None, (1, 2)), BlockKey(None, (3, 4))
    b._hash = a._hash  # force a collision
    assert a != b
    assert len({a: 0, b: 1}) == 2
    child_a, child_b = BlockKey(a, (9, 9)), BlockKey(b, (9, 9))
    assert hash(child_a) == hash(child_b) and child_a != child_b


def test_long_chains_compare_without_recursion():
    a = b = None
    for i in range(5000):
        a, b = BlockKey(a, (i,)), BlockKey(b, (i,))
    assert a == b


# Lookup and reference counts.


def test_a_shared_prefix_is_found_block_by_block():
    bm = BlockManager(16, SIZE, enable_caching=True)
    first = make_seq("a", range(10))  # blocks [0-3] [4-7] full, [8-9] partial
    assert admit(bm, first).num_tokens == 0
    for prompt, hit in [(range(6), 4), (range(8), 4), (range(9), 8), (range(12), 8)]:
        assert bm.find_cached_prefix(make_seq("x", prompt)).num_tokens == hit
    prefix = bm.find_cached_prefix(make_seq("b", [*range(8), 99]))
    assert prefix.block_ids == first.block_table[:2]
    assert bm.find_cached_prefix(make_seq("c", [0, 1, 2, 9, 4, 5, 6, 7, 8])).num_tokens == 0


def test_a_full_hit_still_leaves_one_block_to_compute():
    bm = BlockManager(16, SIZE, enable_caching=True)
    admit(bm, make_seq("a", range(8)))
    twin = make_seq("b", range(8))
    prefix = admit(bm, twin)
    # Eight tokens, all cached: the last block is computed again, into a block of its own.
    assert prefix.num_tokens == 4
    assert bm.blocks[twin.block_table[0]].ref_count == 2
    assert bm.blocks[twin.block_table[1]].ref_count == 1


def test_taking_a_prefix_counts_references_and_free_drops_them():
    bm = BlockManager(16, SIZE, enable_caching=True)
    seqs = [make_seq(str(i), [*range(8), 100 + i]) for i in range(3)]
    for seq in seqs:
        admit(bm, seq)
    shared = seqs[0].block_table[:2]
    assert all(seq.block_table[:2] == shared for seq in seqs)
    assert [bm.blocks[b].ref_count for b in shared] == [3, 3]
    assert bm.num_shared_blocks == 2
    assert bm.num_free_blocks == 16 - 2 - 3
    bm.free(seqs[0])
    assert [bm.blocks[b].ref_count for b in shared] == [2, 2]
    for seq in seqs[1:]:
        bm.free(seq)
    assert_nothing_held(bm)
    assert bm.num_cached_blocks == 2  # the partial blocks were never cached


def test_a_freed_block_stays_findable_and_is_taken_back():
    bm = BlockManager(8, SIZE, enable_caching=True)
    first = make_seq("a", range(9))
    admit(bm, first)
    cached = first.block_table[:2]
    bm.free(first)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    again = make_seq("b", range(9))
    prefix = admit(bm, again)
    assert prefix.block_ids == cached
    assert again.block_table[:2] == cached
    assert bm.num_free_blocks == 8 - 3


def test_allocation_counts_revived_cached_blocks_against_the_free_ones():
    bm = BlockManager(3, SIZE, enable_caching=True)
    first = make_seq("a", range(9))
    admit(bm, first)
    bm.free(first)  # two cached blocks and one uncached, all free
    seq = make_seq("b", [*range(8), *range(50, 55)])  # 2 cached blocks + 5 tokens: 2 new blocks
    prefix = bm.find_cached_prefix(seq)
    assert prefix.num_tokens == 8
    assert not bm.allocate(seq, 5, prefix)
    assert seq.block_table == [] and bm.num_free_blocks == 3
    assert bm.allocate(seq, 4, prefix)
    assert bm.num_free_blocks == 0


def test_a_block_computed_twice_is_cached_once_and_the_chain_goes_on():
    bm = BlockManager(16, SIZE, enable_caching=True)
    a, b = make_seq("a", range(12)), make_seq("b", range(12))
    # Both admitted before either's blocks were registered.
    assert bm.allocate(a, 12) and bm.allocate(b, 12)
    assert bm.num_cached_blocks == 3
    assert not set(a.block_table) & set(b.block_table)
    assert b.block_keys == a.block_keys  # b's keys point at a's cached blocks
    prefix = bm.find_cached_prefix(make_seq("c", range(13)))
    assert prefix.block_ids == a.block_table
    bm.free(a)
    bm.free(b)
    assert_nothing_held(bm)
    assert bm.num_cached_blocks == 3


def test_caching_off_registers_and_finds_nothing():
    bm = BlockManager(8, SIZE)
    seq = make_seq("a", range(9))
    admit(bm, seq)
    assert bm.num_cached_blocks == 0 and seq.block_keys == []
    assert bm.find_cached_prefix(make_seq("b", range(9))).num_tokens == 0
    bm.free(seq)
    assert_nothing_held(bm)


# Eviction.


def test_uncached_free_blocks_go_before_any_cached_one():
    bm = BlockManager(6, SIZE, enable_caching=True)
    seq = make_seq("a", range(8))
    admit(bm, seq)
    bm.free(seq)
    other = make_seq("b", range(100, 116))  # four blocks: exactly the uncached ones
    admit(bm, other)
    assert bm.num_cached_blocks == 2 + 4
    assert bm.find_cached_prefix(make_seq("c", range(9))).num_tokens == 8


def test_eviction_takes_the_least_recently_freed_block_tail_first():
    bm = BlockManager(6, SIZE, enable_caching=True)
    old, new = make_seq("old", range(8)), make_seq("new", range(50, 58))
    admit(bm, old)
    admit(bm, new)
    filler = make_seq("filler", range(100, 108))
    admit(bm, filler)  # holds the last two blocks, so only cached ones are free
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 6
    taker = make_seq("t", range(900, 905))
    assert bm.allocate(taker, 1)
    # old's tail went first; its head block is still found.
    assert bm.find_cached_prefix(make_seq("x", range(9))).num_tokens == 4
    taker.num_computed_tokens = 1
    assert bm.allocate(taker, 4)  # a second block: old's head
    assert bm.find_cached_prefix(make_seq("x", range(9))).num_tokens == 0
    assert bm.find_cached_prefix(make_seq("y", range(50, 59))).num_tokens == 8
    assert bm.num_cached_blocks == 6 - 2 + 1  # two evicted, the taker's first block now full


# Copy on write and forks.


def test_a_fork_shares_every_block_and_copies_the_partial_one_on_write():
    bm = BlockManager(16, SIZE, enable_caching=True)
    parent = make_seq("a", range(10))
    admit(bm, parent)
    child = parent.fork(1)
    bm.share(child)
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2, 2]
    assert bm.num_shared_blocks == 3
    for seq in (parent, child):
        seq.token_ids.append(FAKE_TOKEN + seq.sample_index)
    assert bm.allocate(parent, 1)
    partial = child.block_table[2]
    assert parent.block_table[:2] == child.block_table[:2]
    assert parent.block_table[2] != partial
    assert bm.take_pending_copies() == [(partial, parent.block_table[2])]
    assert bm.blocks[partial].ref_count == 1
    assert bm.allocate(child, 1)  # the last holder writes in place
    assert child.block_table[2] == partial and bm.take_pending_copies() == []
    assert bm.num_shared_blocks == 2
    bm.free(parent)
    bm.free(child)
    assert_nothing_held(bm)


def test_a_fork_of_a_block_aligned_prompt_needs_no_copy():
    bm = BlockManager(16, SIZE, enable_caching=True)
    parent = make_seq("a", range(8))
    admit(bm, parent)
    child = parent.fork(1)
    bm.share(child)
    for seq in (parent, child):
        seq.token_ids.append(FAKE_TOKEN)
        assert bm.allocate(seq, 1)
    assert bm.take_pending_copies() == []
    assert parent.block_table[2] != child.block_table[2]


def test_copy_on_write_fails_cleanly_without_a_free_block():
    bm = BlockManager(3, SIZE, enable_caching=True)
    parent = make_seq("a", range(6))
    admit(bm, parent)
    child = parent.fork(1)
    bm.share(child)
    filler = make_seq("f", range(50, 54))
    admit(bm, filler)
    parent.token_ids.append(FAKE_TOKEN)
    assert not bm.allocate(parent, 1)
    assert bm.take_pending_copies() == [] and bm.blocks[parent.block_table[1]].ref_count == 2


def test_four_samples_hold_the_prompts_full_blocks_once():
    scheduler = make_scheduler(num_blocks=32)
    seq = make_seq("a", range(10), max_tokens=3, n=4)  # 2 full blocks and 2 tokens
    scheduler.add(seq)
    batch = scheduler.schedule()
    samples = [seq, *batch.forks[seq]]
    assert [s.sample_index for s in samples] == [0, 1, 2, 3]
    assert len({s.seed for s in samples}) == 4
    fake_step(scheduler, batch)
    check_accounting(scheduler)
    assert len(scheduler.running) == 4
    assert len({b for s in samples for b in s.block_table}) == 3
    assert [scheduler.block_manager.blocks[b].ref_count for b in seq.block_table] == [4, 4, 4]
    batch = scheduler.schedule()  # each sample writes its first token: 3 copies of the partial
    assert len(batch.block_copies) == 3
    fake_step(scheduler, batch)
    check_accounting(scheduler)
    held = {b for s in samples for b in s.block_table}
    assert len(held) == 2 + 4
    assert all(scheduler.block_manager.blocks[b].ref_count == 4 for b in seq.block_table[:2])
    assert [s.output_token_ids[0] for s in samples] == [7, 8, 9, 10]
    run_until_done(scheduler)
    assert all(s.num_output_tokens == 3 for s in samples)
    assert_nothing_held(scheduler.block_manager)


def test_a_request_for_n_samples_reserves_n_seats():
    scheduler = make_scheduler(num_blocks=32, max_num_seqs=4)
    wide, narrow = make_seq("wide", range(5), n=3), make_seq("narrow", range(5))
    late = make_seq("late", range(5))
    for seq in (wide, narrow, late):
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert [s.request_id for s, _ in batch.entries] == ["wide", "narrow"]
    assert len(scheduler.running) == 4 and list(scheduler.waiting) == [late]


# The scheduler with the cache.


def test_a_request_admitted_in_the_same_step_takes_the_blocks_being_computed():
    scheduler = make_scheduler(num_blocks=32)
    first, second = make_seq("a", range(13)), make_seq("b", [*range(12), 77])
    scheduler.add(first)
    scheduler.add(second)
    batch = scheduler.schedule()
    assert [(s.request_id, n) for s, n in batch.entries] == [("a", 13), ("b", 1)]
    assert (batch.prefix_queried_tokens, batch.prefix_hit_tokens) == (26, 12)
    assert second.block_table[:3] == first.block_table[:3]


def test_a_preempted_sequence_comes_back_to_its_cached_blocks():
    scheduler = make_scheduler(num_blocks=5)
    a, b = make_seq("a", range(8), max_tokens=8), make_seq("b", range(50, 58), max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    fake_step(scheduler, scheduler.schedule())
    b_blocks = list(b.block_table)
    batch = scheduler.schedule()  # a and b each need a third block; only one is free
    assert [s.request_id for s, _ in batch.entries] == ["a"]
    assert batch.preempted == [b]
    fake_step(scheduler, batch)
    assert scheduler.block_manager.num_cached_blocks == 4
    a_done = scheduler.finish(a, "abort")
    assert a_done == [a]
    batch = scheduler.schedule()
    assert batch.entries == [(b, 1)]  # 9 tokens: 2 blocks found, 1 token computed
    assert b.block_table[:2] == b_blocks
    assert batch.prefix_hit_tokens == 8


@pytest.mark.parametrize("budget", [6, 64])
def test_heavy_load_with_shared_prefixes_leaks_nothing(budget):
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=6, budget=budget)
    system = list(range(100, 109))
    seqs = []
    for i in range(12):
        prompt = system[: 3 + (i * 5) % 7] + [i] * (i % 4)
        seqs.append(make_seq(f"r{i}", prompt, max_tokens=3 + i % 4, n=1 + i % 3))
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(3):
        fake_step(scheduler, scheduler.schedule())
        check_accounting(scheduler)
    aborted = [s for s in [*scheduler.running, *scheduler.waiting] if s.request_id == "r7"]
    assert aborted  # waiting, or mid-prompt, or forked
    for sample in aborted:
        scheduler.finish(sample, "abort")
    check_accounting(scheduler)
    seen = run_until_done(scheduler)
    assert scheduler.num_preemptions > 0
    assert seen["hits"] > 0 and seen["forks"] > 0 and seen["copies"] > 0
    assert_nothing_held(scheduler.block_manager)
