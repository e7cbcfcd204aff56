"""A pool of KV block ids with refcounts and a prefix cache: the target's GPU pool
(scheduler/block_manager.py) and the draft model's (runtime/spec/draft_model.py).

Invariants:
  - a block is either referenced (refcount > 0) or in `free_blocks`, never both;
  - a full block of known tokens is registered under its chain hash (`chain_hashes`); a free block
    keeps its hash, and lookups find it, until it is reused (least recently freed first out).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

NO_HASH = None


def chain_hashes(
    token_ids: Sequence[int], block_size: int, num_tokens: int, hashes: list[int]
) -> None:
    """Extend `hashes` (those of the first blocks, in order) over the full blocks of the first
    num_tokens tokens: block i's hash covers block i's tokens and, through its parent's, every
    token before them."""
    num_full = min(num_tokens, len(token_ids)) // block_size
    while len(hashes) < num_full:
        i = len(hashes)
        parent = hashes[-1] if i else 0
        hashes.append(hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))))


class CachedBlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [NO_HASH] * num_blocks
        self.cached_blocks: dict[int, int] = {}  # hash -> block id
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The blocks holding the longest cached run of `hashes` from the first."""
        hits = []
        for block_hash in hashes:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def register(self, block_id: int, block_hash: int) -> None:
        """The block holds the tokens `block_hash` stands for (a hash already cached keeps its
        block; a block registered once keeps its hash)."""
        if self.block_hash[block_id] is NO_HASH and block_hash not in self.cached_blocks:
            self.cached_blocks[block_hash] = block_id
            self.block_hash[block_id] = block_hash

    def take(self) -> int:
        """A free block, referenced once; its old contents leave the cache."""
        block_id, _ = self.free_blocks.popitem(last=False)
        old_hash = self.block_hash[block_id]
        if old_hash is not NO_HASH:
            if self.cached_blocks.get(old_hash) == block_id:
                del self.cached_blocks[old_hash]
            self.block_hash[block_id] = NO_HASH
        self.ref_counts[block_id] = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """One more reference to a block (a cache hit, free or not)."""
        if self.ref_counts[block_id] == 0:
            del self.free_blocks[block_id]
        self.ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """One reference fewer to each of a sequence's blocks, last first out of the cache."""
        for block_id in reversed(block_ids):
            self.release(block_id)

    def release(self, block_id: int, reuse_first: bool = False) -> None:
        """One reference fewer; at none the block is free (reuse_first: the next to be taken)."""
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_counts[block_id] == 0:
            self.free_blocks[block_id] = None
            if reuse_first:
                self.free_blocks.move_to_end(block_id, last=False)
