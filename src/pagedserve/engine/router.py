"""Which replica takes a request: the one whose prefix cache most likely holds the prompt's
leading blocks, else the least loaded.

The router cannot see a replica's cache, so it keeps its own account, as SGLang's router does:
for each replica, the hashes of the block keys (engine/block_key.py, the engine's own) of the
full prompt blocks it sent there, least recently sent first, at most as many as the replica's
cache holds. A prompt matches a replica by the number of its leading blocks found in that
account, stopping at the first miss (the engine's prefix cache reuses only a leading run).

Invariants: load[r] is the number of requests sent to replica r that have not ended; a replica
that is down is never chosen, and its account is emptied (it restarts with an empty cache).
Torch-free and Ray-free: tests drive it directly.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from pagedserve.engine.block_key import BlockKey

ROUTING_POLICIES = ("prefix", "least_loaded", "round_robin")


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The hashes of the prompt's full blocks' keys, in order, as the engine's block manager
    makes the keys (the last prompt token is always computed, so a block holding it is not
    counted). A collision can only send a request to the wrong replica, never hand out KV."""
    key: BlockKey | None = None
    hashes: list[int] = []
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        key = BlockKey(key, tuple(token_ids[start : start + block_size]))
        hashes.append(hash(key))
    return hashes


class Router:
    def __init__(
        self,
        num_replicas: int,
        capacity_blocks: int,
        policy: str = "prefix",
        max_imbalance: int = 8,
    ):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.policy = policy
        self.capacity_blocks = capacity_blocks
        # A prefix match is given up for a replica this many requests busier than the least
        # loaded: past it, waiting for a seat costs more than recomputing the prefix.
        self.max_imbalance = max_imbalance
        self.load = [0] * num_replicas
        self.up = [True] * num_replicas
        self._held: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._turn = itertools.count()

    def choose(self, keys: list[int], exclude: frozenset[int] = frozenset()) -> tuple[int, str]:
        """The replica for a prompt of these block hashes and why ("prefix", "least_loaded" or
        "round_robin"); ValueError-free, but RuntimeError when no replica is up."""
        candidates = [r for r, up in enumerate(self.up) if up and r not in exclude]
        if not candidates:
            raise RuntimeError("no replica is up")
        turn = next(self._turn)
        if self.policy == "round_robin":
            return candidates[turn % len(candidates)], "round_robin"
        least = min(self.load[r] for r in candidates)
        if self.policy == "prefix":
            matches = {r: self._matched_blocks(r, keys) for r in candidates}
            best = max(candidates, key=lambda r: (matches[r], -self.load[r]))
            if matches[best] > 0 and self.load[best] <= least + self.max_imbalance:
                return best, "prefix"
        idle = [r for r in candidates if self.load[r] == least]
        return idle[turn % len(idle)], "least_loaded"

    def sent(self, replica: int, keys: list[int]) -> None:
        """A request went to the replica: its blocks are now the most recent there."""
        self.load[replica] += 1
        held = self._held[replica]
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    def ended(self, replica: int) -> None:
        self.load[replica] -= 1

    def set_up(self, replica: int, up: bool) -> None:
        if not up:
            self._held[replica].clear()
        self.up[replica] = up

    def _matched_blocks(self, replica: int, keys: list[int]) -> int:
        held = self._held[replica]
        return next((i for i, key in enumerate(keys) if key not in held), len(keys))
