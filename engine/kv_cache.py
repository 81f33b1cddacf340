"""Paged KV memory: a pool of fixed-size blocks with ref counts and a hashed prefix cache (LRU eviction)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """What the prefix cache holds of a sequence's leading full blocks (a lookup result; nothing is held yet)."""
    blocks: tuple[int, ...] = ()
    hashes: tuple[int, ...] = ()
    num_tokens: int = 0


NO_PREFIX = CachedPrefix()


class KVCacheManager:
    """Gives sequences blocks for the tokens they are about to compute, reusing cached prefixes. The scheduler sees
    only this: pure lookups (the prefix cache, a fork of another sequence's prompt), one allocate that commits
    everything or nothing, commit, free, and the free count."""

    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The cached blocks that cover the sequence's leading full blocks. Changes nothing."""
        if not self.enable_prefix_caching or seq.block_table:
            return NO_PREFIX
        bs = self.block_size
        blocks, hashes = [], []
        parent = None
        for i in range(seq.num_cacheable_tokens // bs):
            h = hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs])
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        return CachedPrefix(tuple(blocks), tuple(hashes), len(blocks) * bs) if blocks else NO_PREFIX

    def fork_prefix(self, src: Sequence, dst: Sequence) -> CachedPrefix:
        """src's computed full blocks that hold dst's leading tokens, short of dst's last cacheable one (dst computes
        at least that itself, so it samples its own next token): shared by reference count at allocate, so it works
        with prefix caching off too. Changes nothing."""
        if dst.block_table or not src.block_table:
            return NO_PREFIX
        bs = self.block_size
        n = min(src.num_computed_tokens, dst.num_cacheable_tokens) // bs
        n = min(n, len(src.block_table), len(src.block_hashes) if self.enable_prefix_caching else n)
        if n <= 0 or src.token_ids[:n * bs] != dst.token_ids[:n * bs]:
            return NO_PREFIX
        hashes = tuple(src.block_hashes[:n]) if self.enable_prefix_caching else ()
        return CachedPrefix(tuple(src.block_table[:n]), hashes, n * bs)

    def blocks_to_take(self, seq: Sequence, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> int:
        """Free blocks that allocate(seq, num_new_tokens, prefix) would take from the pool: new blocks plus cached
        prefix blocks no live sequence holds."""
        computed = prefix.num_tokens if prefix.blocks else seq.num_computed_tokens
        new = max(0, self.blocks_for(computed + num_new_tokens) - len(seq.block_table) - len(prefix.blocks))
        return new + sum(1 for b in prefix.blocks if self.pool.ref_counts[b] == 0)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX, reserve: int = 0
                 ) -> bool:
        """Attach `prefix` and make room for num_new_tokens more tokens after it (after what seq has computed, without
        one), leaving at least `reserve` blocks free; False, with nothing changed, if the pool is short. The caller
        (the scheduler) counts the prefix's tokens as computed: this writes block tables only."""
        if self.blocks_to_take(seq, num_new_tokens, prefix) > self.pool.num_free - reserve:
            return False
        computed = seq.num_computed_tokens
        if prefix.blocks:
            for block in prefix.blocks:  # taken first, so the new blocks below cannot evict them
                self.pool.acquire(block)
            seq.block_table.extend(prefix.blocks)
            seq.block_hashes.extend(prefix.hashes)
            computed = prefix.num_tokens
        need = self.blocks_for(computed + num_new_tokens) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need))
        return True

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
