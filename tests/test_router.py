"""The replica router's policy, torch-free: which replica takes a request, and why."""

import pytest

from pagedserve.engine.block_key import BlockKey
from pagedserve.engine.router import Router, prompt_block_hashes

BLOCK = 4


def _prompt(prefix: int, length: int, tail: int) -> list[int]:
    """length tokens: prefix picks the leading ones, tail the rest."""
    return [1000 * prefix + i for i in range(length - 3)] + [tail, tail + 1, tail + 2]


def test_block_hashes_are_the_engines_keys_of_the_full_blocks_before_the_last_token():
    tokens = list(range(13))
    keys: list[BlockKey] = []
    for start in (0, 4, 8):  # the block holding token 12 is not full; 0-11 are three blocks
        keys.append(BlockKey(keys[-1] if keys else None, tuple(tokens[start : start + 4])))
    assert prompt_block_hashes(tokens, BLOCK) == [hash(key) for key in keys]
    # Twelve tokens: the last is always computed, so its block is not a cache hit.
    assert prompt_block_hashes(tokens[:12], BLOCK) == [hash(key) for key in keys[:2]]
    assert prompt_block_hashes([], BLOCK) == []


def test_a_shared_prefix_goes_where_it_went_before_and_the_rest_spread():
    router = Router(2, capacity_blocks=100)
    first = prompt_block_hashes(_prompt(1, 40, 7), BLOCK)
    replica, reason = router.choose(first)
    assert reason == "least_loaded"
    router.sent(replica, first)
    again = prompt_block_hashes(_prompt(1, 40, 9), BLOCK)
    assert router.choose(again) == (replica, "prefix")
    router.sent(replica, again)
    other = prompt_block_hashes(_prompt(2, 40, 7), BLOCK)
    assert router.choose(other) == (1 - replica, "least_loaded")


def test_the_longest_leading_match_wins_and_a_match_must_start_at_the_first_block():
    router = Router(3, capacity_blocks=100)
    long = prompt_block_hashes(_prompt(1, 41, 7), BLOCK)
    router.sent(0, long[:2])
    router.sent(2, long[:6])
    assert router.choose(long) == (2, "prefix")
    # Blocks held out of order are no match: the engine reuses only a leading run.
    router = Router(2, capacity_blocks=100)
    router.sent(1, long[1:])
    assert router.choose(long)[1] == "least_loaded"


def test_a_busy_replica_gives_up_its_prefix_to_the_least_loaded():
    router = Router(2, capacity_blocks=100, max_imbalance=2)
    keys = prompt_block_hashes(_prompt(1, 40, 7), BLOCK)
    router.sent(0, keys)
    router.sent(0, [])
    assert router.choose(keys) == (0, "prefix")  # 2 against 0: within the slack
    router.sent(0, [])
    assert router.choose(keys) == (1, "least_loaded")
    for _ in range(3):
        router.ended(0)
    assert router.choose(keys) == (0, "prefix")


def test_the_account_forgets_the_least_recently_sent_blocks_beyond_the_cache():
    router = Router(2, capacity_blocks=4)
    old = prompt_block_hashes(_prompt(1, 21, 7), BLOCK)  # 5 blocks: the first falls out
    router.sent(0, old)
    router.ended(0)
    assert router.choose(old)[1] == "least_loaded"
    recent = prompt_block_hashes(_prompt(2, 13, 7), BLOCK)  # 3 blocks
    router.sent(0, recent)
    router.ended(0)
    assert router.choose(recent) == (0, "prefix")


def test_a_replica_that_is_down_gets_nothing_and_comes_back_with_an_empty_account():
    router = Router(2, capacity_blocks=100)
    keys = prompt_block_hashes(_prompt(1, 40, 7), BLOCK)
    router.sent(0, keys)
    router.set_up(0, False)
    assert [router.choose(keys)[0] for _ in range(4)] == [1, 1, 1, 1]
    router.set_up(1, False)
    with pytest.raises(RuntimeError, match="no replica is up"):
        router.choose(keys)
    router.set_up(0, True)
    assert router.choose(keys) == (0, "least_loaded")
    assert router.choose(keys, exclude=frozenset({1})) == (0, "least_loaded")


def test_round_robin_and_least_loaded_ignore_prefixes():
    keys = prompt_block_hashes(_prompt(1, 40, 7), BLOCK)
    router = Router(3, capacity_blocks=100, policy="round_robin")
    router.sent(0, keys)
    assert [router.choose(keys) for _ in range(4)] == [
        (0, "round_robin"), (1, "round_robin"), (2, "round_robin"), (0, "round_robin")
    ]  # fmt: skip
    router = Router(2, capacity_blocks=100, policy="least_loaded")
    router.sent(0, keys)
    assert router.choose(keys) == (1, "least_loaded")
    with pytest.raises(ValueError, match="routing policy must be one of"):
        Router(2, 100, policy="random")
