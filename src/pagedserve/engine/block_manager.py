"""Hands out the fixed-size KV blocks of the paged cache and counts who holds each one.

Plain Python, no tensors: a block is an index into the per-layer cache tensors.

Sharing comes two ways. With prefix caching, every full block is registered under a key made of
its tokens and its parent block's key, so a new request that starts with the same tokens takes
those blocks instead of computing them again. A block nobody holds any more keeps its key and
stays findable until it is needed for something else: uncached free blocks are handed out first,
then cached ones, least recently freed first. And a sequence can be forked (parallel samples):
the fork holds every block of its parent, and the first write into a shared, partly filled block
copies it (copy on write); the copies are queued for the model runner to do before the step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pagedserve.engine.block_key import BlockKey
from pagedserve.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None  # set while the block is findable in the prefix cache


@dataclass
class CachedPrefix:
    """The cached full blocks a sequence starts with, and their keys."""

    block_ids: list[int] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)
    num_tokens: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self._free_ids: deque[int] = deque(range(num_blocks))  # held by nobody, not cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # held by nobody, cached; LRU
        self._cached: dict[BlockKey, int] = {}
        self.num_shared_blocks = 0  # blocks with more than one holder
        # (source, destination) block copies the runner must make before the next forward.
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks held by no sequence, cached or not: all can be handed out."""
        return len(self._free_ids) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """The fraction of blocks held by some sequence."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def block_states(self) -> str:
        """A letter a block, by block id: "s" held by several sequences, "u" by one, "c" held by
        none but cached (findable, evicted last), "f" free. For the live page; O(blocks)."""
        return "".join(
            ("s" if b.ref_count > 1 else "u")
            if b.ref_count
            else ("c" if b.key is not None else "f")
            for b in self.blocks
        )

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest chain of cached full blocks that seq's tokens begin with; takes nothing.

        At least one token is left out so that computing it yields logits, and the hit stays
        whole blocks so that no sequence ever writes into a block it found in the cache. A
        request for prompt logprobs takes no hit: it needs the logits of every prompt position.
        """
        prefix = CachedPrefix()
        if not self.enable_caching or seq.params.prompt_logprobs is not None:
            return prefix
        size = self.block_size
        parent: BlockKey | None = None
        for start in range(0, (seq.num_tokens - 1) // size * size, size):
            key = BlockKey(parent, tuple(seq.token_ids[start : start + size]))
            block_id = self._cached.get(key)
            if block_id is None:
                break
            parent = self.blocks[block_id].key
            prefix.block_ids.append(block_id)
            prefix.keys.append(parent)
        prefix.num_tokens = len(prefix.block_ids) * size
        return prefix

    def allocate(
        self, seq: Sequence, num_new_tokens: int, prefix: CachedPrefix | None = None
    ) -> bool:
        """Grows seq's block table to hold its computed tokens plus num_new_tokens.

        A sequence holding no blocks may first take a cached prefix: its blocks start the table
        and its tokens count as computed; num_new_tokens then counts the tokens after it. Takes
        nothing and returns False when the free blocks do not suffice.
        """
        prefix = prefix or CachedPrefix()
        num_computed = seq.num_computed_tokens + prefix.num_tokens
        copy = self._needs_copy(seq)
        num_appended = self.blocks_for(num_computed + num_new_tokens)
        num_appended -= len(seq.block_table) + len(prefix.block_ids)
        revived = sum(1 for block_id in prefix.block_ids if self.blocks[block_id].ref_count == 0)
        if num_appended + copy + revived > self.num_free_blocks:
            return False
        if prefix.block_ids:
            for block_id in prefix.block_ids:
                self._ref(block_id)
            seq.block_table = list(prefix.block_ids)
            seq.block_keys = list(prefix.keys)
            seq.num_computed_tokens = num_computed
        if copy:
            self._copy_on_write(seq)
        seq.block_table.extend(self._take_free() for _ in range(num_appended))
        self._register_full_blocks(seq, num_computed + num_new_tokens)
        return True

    def share(self, seq: Sequence) -> None:
        """Takes one more reference on every block in seq's table (seq is a new fork)."""
        for block_id in seq.block_table:
            self._ref(block_id)

    def free(self, seq: Sequence) -> None:
        """Drops seq's references; blocks nobody else holds become free, cached ones findable."""
        # The tail first, so that it is evicted before the head, which others more likely share.
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []
        seq.block_keys = []
        seq.num_computed_tokens = 0

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _needs_copy(self, seq: Sequence) -> bool:
        """Whether seq's next token lands in a partly filled block that someone else holds."""
        index = seq.num_computed_tokens // self.block_size
        return index < len(seq.block_table) and self.blocks[seq.block_table[index]].ref_count > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        index = seq.num_computed_tokens // self.block_size
        shared = seq.block_table[index]
        private = self._take_free()
        self._unref(shared)
        seq.block_table[index] = private
        self.pending_copies.append((shared, private))

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Makes seq's blocks that are full once num_tokens are in the cache findable.

        Registered before the step computes them: every layer writes a step's new keys and
        values before it reads any, so another sequence may use them within the same step.
        """
        if not self.enable_caching:
            return
        size = self.block_size
        keys = seq.block_keys
        for index in range(len(keys), num_tokens // size):
            tokens = tuple(seq.token_ids[index * size : (index + 1) * size])
            key = BlockKey(keys[-1] if keys else None, tokens)
            block = self.blocks[seq.block_table[index]]
            cached_id = self._cached.setdefault(key, block.block_id)
            if cached_id == block.block_id:
                block.key = key
            else:
                # Another sequence computed the same tokens first; this copy stays private.
                key = self.blocks[cached_id].key
            keys.append(key)

    def _take_free(self) -> int:
        if self._free_ids:
            block = self.blocks[self._free_ids.popleft()]
        else:
            block = self.blocks[self._evictable.popitem(last=False)[0]]
            del self._cached[block.key]
            block.key = None
        block.ref_count = 1
        return block.block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1
        if block.ref_count == 2:
            self.num_shared_blocks += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 1:
            self.num_shared_blocks -= 1
        elif block.ref_count == 0:
            if block.key is None:
                self._free_ids.append(block_id)
            else:
                self._evictable[block_id] = None
