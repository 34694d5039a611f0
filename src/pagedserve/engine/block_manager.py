"""Hands out the fixed-size KV blocks of the paged cache and counts who holds each one.

Plain Python, no tensors: a block is an index into the per-layer cache tensors. Reference counts
are kept from the start so that blocks can later be shared between sequences (prefix caching,
parallel samples) without changing this interface.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedserve.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self._free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    @property
    def usage(self) -> float:
        """The fraction of blocks held by some sequence."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grows seq's block table to hold its computed tokens plus num_new_tokens.

        Takes nothing and returns False when the free blocks do not suffice.
        """
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            block = self.blocks[self._free_ids.popleft()]
            block.ref_count = 1
            seq.block_table.append(block.block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Drops seq's references; blocks nobody else holds go back to the pool at once."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
