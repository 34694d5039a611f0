"""The prefix cache's key for a full block, held by sequences and looked up by the block manager."""

from __future__ import annotations


class BlockKey:
    """A full block's cache key: its token ids and, through its parent, every token before them.

    Equality walks the whole chain, so a hash collision can never hand out another prompt's KV;
    the hash, computed once, only picks the bucket. Keys built on a cached parent share that
    parent object, which ends the walk after one block.
    """

    __slots__ = ("_hash", "parent", "token_ids")

    def __init__(self, parent: BlockKey | None, token_ids: tuple[int, ...]):
        self.parent = parent
        self.token_ids = token_ids
        self._hash = hash((None if parent is None else parent._hash, token_ids))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockKey):
            return NotImplemented
        a: BlockKey | None = self
        b: BlockKey | None = other
        while a is not b:  # a loop, not recursion: chains can be thousands of blocks long
            if a is None or b is None or a._hash != b._hash or a.token_ids != b.token_ids:
                return False
            a, b = a.parent, b.parent
        return True
