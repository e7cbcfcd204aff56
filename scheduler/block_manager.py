"""KV block ids and refcounts for the GPU pool and the CPU swap pool, with prefix caching.

Invariants:
  - the GPU pool's (scheduler/block_pool.py): a block is referenced or free, never both; a free
    block may still carry a hash and be found by prefix lookups until it is reused;
  - block i of a request holds its tokens [i * block_size, (i + 1) * block_size).
Tensors belong to runtime/; this class only hands out ids.
"""

from __future__ import annotations

from scheduler.block_pool import CachedBlockPool, chain_hashes
from scheduler.request import Request


class BlockManager:
    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = CachedBlockPool(num_gpu_blocks)  # the GPU blocks
        self.free_cpu_blocks: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.num_prefix_queries = 0  # tokens looked up
        self.num_prefix_hits = 0  # tokens found

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_gpu_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.free_cpu_blocks)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------
    def hash_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes over the full blocks of its first num_tokens tokens
        (known ones only: a pending token is hashed once it lands)."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        if self.enable_prefix_caching and len(request.block_hashes) < num_full:
            chain_hashes(request.all_token_ids, self.block_size, num_tokens, request.block_hashes)

    def find_cached_blocks(self, request: Request) -> list[int]:
        """GPU blocks holding the longest cached prefix; the last token is always left to compute."""
        if not self.enable_prefix_caching:
            return []
        num_full = (request.num_tokens - 1) // self.block_size
        self.hash_full_blocks(request, num_full * self.block_size)
        return self.pool.lookup(request.block_hashes[:num_full])

    # ---- allocation -------------------------------------------------------------------------
    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_cached: int = 0) -> int:
        total = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, total - len(request.block_ids) - num_cached)

    def can_allocate(self, request: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        num_evictable_hits = sum(1 for b in cached if self.pool.ref_counts[b] == 0)
        needed = self.num_blocks_needed(request, num_new_tokens, len(cached))
        return needed + num_evictable_hits <= self.num_free_gpu_blocks

    def allocate(self, request: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Give the request blocks for num_new_tokens more tokens (after taking the cached prefix
        blocks `cached`, which must directly follow its current blocks). False changes nothing."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        if not cached and num_tokens <= len(request.block_ids) * self.block_size:
            if num_tokens // self.block_size > len(request.block_hashes):
                self._cache_computed_blocks(request, num_tokens)
            return True  # a decode inside the blocks it has
        if not self.can_allocate(request, num_new_tokens, cached):
            return False
        for block_id in cached:
            self.pool.touch(block_id)
        request.block_ids.extend(cached)
        needed = self.num_blocks_needed(request, num_new_tokens)
        request.block_ids.extend(self.pool.take() for _ in range(needed))
        self._cache_computed_blocks(request, num_tokens)
        return True

    def _cache_computed_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        self.hash_full_blocks(request, num_tokens)
        for block_id, block_hash in zip(request.block_ids, request.block_hashes):
            self.pool.register(block_id, block_hash)

    def free(self, request: Request) -> None:
        """Release the request's GPU blocks, last block first out of the cache."""
        self.pool.free(request.block_ids)
        request.block_ids = []
        self.free_cpu(request)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release the request's blocks past its first num_tokens tokens (rejected drafts' slots:
        never hashed), first in line to be reused."""
        num_kept = self.num_blocks_for(num_tokens)
        for block_id in request.block_ids[num_kept:]:
            self.pool.release(block_id, reuse_first=True)
        del request.block_ids[num_kept:]

    def free_cpu(self, request: Request) -> None:
        self.free_cpu_blocks.extend(reversed(request.cpu_block_ids))
        request.cpu_block_ids = []

    # ---- swapping ---------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return len(request.block_ids) <= self.num_free_cpu_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the CPU pool; returns (gpu, cpu) copies to make."""
        assert self.can_swap_out(request)
        cpu_ids = [self.free_cpu_blocks.pop() for _ in request.block_ids]
        mapping = list(zip(request.block_ids, cpu_ids))
        self.free(request)
        request.cpu_block_ids = cpu_ids
        return mapping

    def can_swap_in(self, request: Request) -> bool:
        return len(request.cpu_block_ids) <= self.num_free_gpu_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request back to fresh GPU blocks; returns (cpu, gpu) copies to make."""
        assert self.can_swap_in(request) and not request.block_ids
        gpu_ids = [self.pool.take() for _ in request.cpu_block_ids]
        mapping = list(zip(request.cpu_block_ids, gpu_ids))
        self.free_cpu(request)
        request.block_ids = gpu_ids
        self._cache_computed_blocks(request, request.num_computed_tokens)
        return mapping
