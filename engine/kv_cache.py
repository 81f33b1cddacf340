"""Paged KV memory: a pool of fixed-size blocks with ref counts and a hashed prefix cache (LRU eviction)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence as Seq

import numpy as np
import xxhash

from engine.request import Sequence


def hash_block(parent: int | None, token_ids: Seq[int]) -> int:
    """Chained block hash: equal hashes mean equal tokens from position 0 to the block's end."""
    h = xxhash.xxh3_128()
    h.update((parent or 0).to_bytes(16, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockPool:
    """Blocks with ref counts. Free blocks keep their hash (reusable) until evicted, oldest-freed first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (evicting cached content if needed), or None without side effects."""
        if n > len(self.free):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def acquire(self, block: int) -> None:
        """Take one more reference on a cached block (a prefix hit)."""
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def release(self, blocks: Seq[int]) -> None:
        # Tail blocks are released first so they sit nearer the eviction end than the shared head.
        for block in reversed(blocks):
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} released more often than acquired")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None

    def register(self, block: int, block_hash: int) -> bool:
        """Publish a full block under its hash; False if identical content is already cached elsewhere."""
        if block_hash in self.cached or self.block_hash[block] is not None:
            return False
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash
        return True

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self.cached[h]
            self.block_hash[block] = None


class KVCacheManager:
    """Gives sequences blocks for the tokens they are about to compute, reusing cached prefixes."""

    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the sequence's leading full blocks; returns the tokens they cover."""
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        bs = self.block_size
        max_blocks = seq.num_cacheable_tokens // bs
        parent = None
        for i in range(max_blocks):
            h = hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs])
            block = self.pool.lookup(h)
            if block is None:
                break
            self.pool.acquire(block)
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed_tokens = len(seq.block_table) * bs
        return seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens; False (nothing changed) if the pool is short."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        seq.block_table.extend(blocks)
        return True

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.pool.num_free

    def commit(self, seq: Sequence) -> None:
        """Hash the blocks that became full, so later sequences with the same prefix can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            h = hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs])
            self.pool.register(seq.block_table[i], h)
            seq.block_hashes.append(h)
            parent = h

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
