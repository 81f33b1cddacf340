"""BlockPool and KVCacheManager: allocation, ref counts, the hashed prefix cache and its LRU eviction."""
from __future__ import annotations

import pytest

from engine.config import SamplingParams
from engine.kv_cache import BlockPool, KVCacheManager, hash_block
from engine.request import Sequence

BS = 4  # block size used throughout: small, so a few tokens make full blocks


def make_seq(token_ids, rid="r", arrival=0) -> Sequence:
    return Sequence(request_id=rid, token_ids=list(token_ids), num_prompt_tokens=len(token_ids),
                    params=SamplingParams(), arrival=arrival, arrival_time=0.0)


def attach_prefix(kv: KVCacheManager, seq: Sequence) -> int:
    """Look up the cached prefix and take it (no new blocks yet), and count its tokens as computed (the scheduler's
    part); returns the tokens it covers."""
    prefix = kv.find_cached_prefix(seq)
    assert kv.allocate(seq, 0, prefix)
    seq.num_computed_tokens = prefix.num_tokens
    return prefix.num_tokens


def prefill(kv: KVCacheManager, seq: Sequence) -> int:
    """What the scheduler and runner do to a new sequence: prefix hit, blocks for the rest, compute, commit."""
    cached = attach_prefix(kv, seq)
    assert kv.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.commit(seq)
    return cached


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.free)


# ---- BlockPool -------------------------------------------------------------------------------------


def test_allocate_and_release_round_trip():
    pool = BlockPool(8)
    assert pool.num_free == 8
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(a) == 3 and len(b) == 5
    assert len(set(a) | set(b)) == 8  # all distinct
    assert pool.num_free == 0
    assert all(pool.ref_counts[x] == 1 for x in a + b)
    pool.release(a)
    assert pool.num_free == 3
    assert all(pool.ref_counts[x] == 0 for x in a)
    pool.release(b)
    assert pool.num_free == 8
    assert pool.ref_counts == [0] * 8


def test_allocate_zero_blocks():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free == 2


def test_allocate_short_returns_none_without_side_effects():
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS)
    s = make_seq(range(9))  # 2 full blocks get hashed
    prefill(kv, s)
    kv.free(s)
    taken = pool.allocate(1)  # one of the 4 is busy; 3 free, 2 of them cached
    before = (free_order(pool), dict(pool.cached), list(pool.block_hash), list(pool.ref_counts))
    assert pool.allocate(4) is None
    assert (free_order(pool), dict(pool.cached), list(pool.block_hash), list(pool.ref_counts)) == before
    assert pool.num_cached == 2  # nothing evicted by the failed call
    pool.release(taken)


def test_manager_allocate_short_returns_false_and_leaves_sequence_alone():
    pool = BlockPool(3)
    kv = KVCacheManager(pool, BS)
    other = pool.allocate(1)
    s = make_seq(range(10))  # needs 3 blocks, 2 free
    before = free_order(pool)
    assert kv.allocate(s, 10) is False
    assert s.block_table == [] and s.num_computed_tokens == 0
    assert free_order(pool) == before
    assert kv.allocate(s, 8) is True
    assert len(s.block_table) == 2 and pool.num_free == 0
    pool.release(other)
    kv.free(s)
    assert pool.num_free == 3


def test_find_cached_prefix_is_a_pure_lookup():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    a = make_seq(range(9), "a")
    prefill(kv, a)
    kv.free(a)
    state = (free_order(pool), dict(pool.cached), list(pool.ref_counts))
    b = make_seq(range(9), "b")
    prefix = kv.find_cached_prefix(b)
    assert prefix.num_tokens == 8 and len(prefix.blocks) == 2
    assert kv.find_cached_prefix(b) == prefix  # asking twice changes nothing either
    assert (free_order(pool), dict(pool.cached), list(pool.ref_counts)) == state
    assert b.block_table == [] and b.num_computed_tokens == 0


def test_allocate_with_a_prefix_commits_everything_or_nothing():
    """The prefix's blocks are free (ref 0) cached blocks, so taking them uses free blocks too: 2 cached + 2 new
    do not fit 3 free blocks, and nothing changes; with a reserve the same holds one block earlier."""
    pool = BlockPool(5)
    kv = KVCacheManager(pool, BS)
    a = make_seq(range(9), "a")
    prefill(kv, a)  # 3 blocks, 2 of them full and cached
    kv.free(a)
    other = pool.allocate(2)  # 3 free left, the 2 cached ones among them
    b = make_seq(list(range(9)) + list(range(100, 107)), "b")  # 16 tokens: 8 cached + 8 new = 2 more blocks
    prefix = kv.find_cached_prefix(b)
    assert prefix.num_tokens == 8
    state = (free_order(pool), dict(pool.cached), list(pool.ref_counts))
    assert kv.blocks_to_take(b, 8, prefix) == 4
    assert kv.allocate(b, 8, prefix) is False
    assert (free_order(pool), dict(pool.cached), list(pool.ref_counts)) == state
    assert b.block_table == [] and b.block_hashes == [] and b.num_computed_tokens == 0
    assert kv.allocate(b, 4, prefix, reserve=1) is False  # 2 cached + 1 new take all 3: none left in reserve
    assert (free_order(pool), dict(pool.cached), list(pool.ref_counts)) == state
    assert kv.allocate(b, 4, prefix) is True  # 8 prefix tokens + 4 new: 3 blocks, 1 of them new
    assert len(b.block_table) == 3 and b.block_table[:2] == list(prefix.blocks) and pool.num_free == 0
    kv.free(b)
    pool.release(other)
    assert pool.num_free == 5


def test_manager_allocate_only_adds_missing_blocks():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    s = make_seq(range(5))
    assert kv.allocate(s, 5)
    assert len(s.block_table) == 2
    s.num_computed_tokens = 5
    s.token_ids += [100, 101, 102]  # 8 tokens: still 2 blocks
    assert kv.allocate(s, 3)
    assert len(s.block_table) == 2
    s.num_computed_tokens = 8
    s.token_ids.append(103)
    assert kv.allocate(s, 1)
    assert len(s.block_table) == 3
    assert pool.num_free == 5
    kv.free(s)
    assert s.block_table == [] and pool.num_free == 8


def test_acquire_release_ref_counts_and_double_release_raises():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.acquire(b)
    assert pool.ref_counts[b] == 2
    pool.release([b])
    assert pool.ref_counts[b] == 1 and b not in pool.free
    pool.release([b])
    assert pool.ref_counts[b] == 0 and b in pool.free
    with pytest.raises(RuntimeError):
        pool.release([b])
    assert pool.ref_counts[b] == 0  # never negative
    assert pool.num_free == 4


def test_acquire_of_free_cached_block_takes_it_off_the_free_list():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    assert pool.register(b, 1234)
    pool.release([b])
    assert b in pool.free and pool.lookup(1234) == b  # free but still cached
    pool.acquire(b)
    assert b not in pool.free and pool.ref_counts[b] == 1
    assert pool.num_free == 3
    # Allocating everything else must not hand out or evict the acquired block.
    others = pool.allocate(3)
    assert b not in others and pool.lookup(1234) == b
    assert pool.allocate(1) is None
    pool.release(others + [b])
    assert pool.num_free == 4


def test_register_duplicate_content_and_rehash_refused():
    pool = BlockPool(4)
    b1, b2 = pool.allocate(2)
    assert pool.register(b1, 7)
    assert not pool.register(b2, 7)  # identical content already cached in b1
    assert pool.lookup(7) == b1
    assert pool.block_hash[b2] is None
    assert not pool.register(b1, 8)  # a block holds one content
    assert pool.lookup(8) is None
    assert pool.num_cached == 1
    pool.release([b1, b2])


# ---- hashing ---------------------------------------------------------------------------------------


def test_hash_block_is_chained():
    toks = [5, 6, 7, 8]
    assert hash_block(None, toks) == hash_block(None, list(toks))
    assert hash_block(None, toks) != hash_block(None, [5, 6, 7, 9])
    parent_a = hash_block(None, [1, 2, 3, 4])
    parent_b = hash_block(None, [1, 2, 3, 5])
    assert hash_block(parent_a, toks) != hash_block(parent_b, toks)
    assert hash_block(parent_a, toks) != hash_block(None, toks)


# ---- prefix cache hits -----------------------------------------------------------------------------


def test_match_prefix_reuses_committed_blocks():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    a = make_seq(prompt, "a")
    assert prefill(kv, a) == 0
    assert len(a.block_hashes) == 2 and pool.num_cached == 2

    b = make_seq(prompt + [1, 2], "b", arrival=1)
    cached = attach_prefix(kv, b)
    assert cached == 8
    assert b.num_computed_tokens == 8
    assert b.block_table == a.block_table[:2]
    assert all(pool.ref_counts[x] == 2 for x in a.block_table[:2])
    assert pool.ref_counts[a.block_table[2]] == 1
    assert kv.allocate(b, b.num_uncomputed_tokens)
    assert len(b.block_table) == 4 and b.block_table[2:] != a.block_table[2:]

    kv.free(a)
    assert all(pool.ref_counts[x] == 1 for x in b.block_table)
    kv.free(b)
    assert pool.num_free == 16 and pool.ref_counts == [0] * 16


def test_match_prefix_hits_blocks_of_a_freed_sequence():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(13))
    a = make_seq(prompt, "a")
    prefill(kv, a)
    blocks = list(a.block_table)
    kv.free(a)
    assert pool.num_free == 8 and pool.num_cached == 3
    b = make_seq(prompt, "b")
    assert attach_prefix(kv, b) == 12
    assert b.block_table == blocks[:3]
    assert pool.num_free == 5
    kv.free(b)


@pytest.mark.parametrize("n", [4, 8, 12])
def test_match_prefix_never_covers_the_last_prompt_token(n):
    """A prompt made of exactly full blocks, all cached: the last block is recomputed for logits."""
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(50, 50 + n))
    a = make_seq(prompt, "a")
    prefill(kv, a)
    assert pool.num_cached == n // BS
    b = make_seq(prompt, "b")
    assert attach_prefix(kv, b) == n - BS
    assert b.num_uncomputed_tokens >= 1
    assert len(b.block_table) == n // BS - 1
    kv.free(a)
    kv.free(b)
    assert pool.num_free == 8


def test_match_prefix_same_block_tokens_under_other_parent_miss():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    head_a, head_b, tail = [1, 2, 3, 4], [9, 9, 9, 9], [5, 6, 7, 8]
    a = make_seq(head_a + tail + [0], "a")
    prefill(kv, a)
    # Same second block, different first block: nothing may be reused.
    b = make_seq(head_b + tail + [0], "b")
    assert attach_prefix(kv, b) == 0
    assert b.block_table == []
    # Second block content alone as a first block: no hit either.
    c = make_seq(tail + [0], "c")
    assert attach_prefix(kv, c) == 0
    # Same first block, different second block: only the first is reused.
    d = make_seq(head_a + [5, 6, 7, 0] + [0], "d")
    assert attach_prefix(kv, d) == 4
    assert d.block_table == a.block_table[:1]
    # b's blocks get their own hashes, distinct from a's.
    assert kv.allocate(b, b.num_uncomputed_tokens)
    b.num_computed_tokens = b.num_tokens
    kv.commit(b)
    assert b.block_hashes[1] != a.block_hashes[1]
    assert pool.block_hash[b.block_table[1]] == b.block_hashes[1]
    for s in (a, b, d):
        kv.free(s)
    assert pool.num_free == 8


def test_commit_hashes_only_full_computed_blocks_incrementally():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    s = make_seq(list(range(10)))
    assert kv.allocate(s, 10)
    s.num_computed_tokens = 3  # a chunk that has not filled a block
    kv.commit(s)
    assert s.block_hashes == [] and pool.num_cached == 0
    s.num_computed_tokens = 9
    kv.commit(s)
    assert len(s.block_hashes) == 2
    assert s.block_hashes[0] == hash_block(None, [0, 1, 2, 3])
    assert s.block_hashes[1] == hash_block(s.block_hashes[0], [4, 5, 6, 7])
    assert pool.lookup(s.block_hashes[1]) == s.block_table[1]
    # Decoding adds tokens; the third block is hashed once it is full and computed.
    s.num_computed_tokens = 10
    s.token_ids += [10, 11]
    kv.commit(s)
    assert len(s.block_hashes) == 2
    assert kv.allocate(s, 2)
    s.num_computed_tokens = 12
    kv.commit(s)
    assert len(s.block_hashes) == 3
    assert s.block_hashes[2] == hash_block(s.block_hashes[1], [8, 9, 10, 11])
    kv.free(s)


def test_duplicate_content_computed_concurrently():
    """Two sequences prefill the same prompt before either commits: both keep their own blocks."""
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(9))
    a, b = make_seq(prompt, "a"), make_seq(prompt, "b")
    for s in (a, b):
        assert attach_prefix(kv, s) == 0
        assert kv.allocate(s, s.num_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        kv.commit(s)
    assert a.block_hashes == b.block_hashes
    assert pool.num_cached == 2
    assert all(pool.lookup(h) in a.block_table for h in a.block_hashes)
    assert all(pool.block_hash[x] is None for x in b.block_table)
    a_hashes = list(a.block_hashes)
    kv.free(b)
    kv.free(a)
    assert pool.num_free == 8 and pool.num_cached == 2
    c = make_seq(prompt, "c")
    assert attach_prefix(kv, c) == 8
    assert c.block_table == [pool.lookup(h) for h in a_hashes]
    kv.free(c)


def test_prefix_caching_disabled():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS, enable_prefix_caching=False)
    prompt = list(range(9))
    a = make_seq(prompt, "a")
    assert prefill(kv, a) == 0
    assert a.block_hashes == [] and pool.num_cached == 0
    b = make_seq(prompt, "b")
    assert attach_prefix(kv, b) == 0 and b.block_table == []
    kv.free(a)
    assert pool.num_free == 8


# ---- eviction (LRU) ---------------------------------------------------------------------------------


def test_eviction_takes_the_tail_of_a_sequence_before_its_head():
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(13))  # 3 full blocks + 1 token: 4 blocks, 3 hashed
    a = make_seq(prompt, "a")
    prefill(kv, a)
    table = list(a.block_table)
    kv.free(a)
    assert pool.num_cached == 3
    # Freed in reverse: the unhashed last block, then the third, second, first.
    assert free_order(pool) == table[::-1]
    pool.allocate(1)  # the unhashed partial block
    assert pool.num_cached == 3
    pool.allocate(1)  # evicts the third (deepest) block, keeps the head
    assert pool.num_cached == 2
    b = make_seq(prompt, "b")
    assert attach_prefix(kv, b) == 8
    assert b.block_table == table[:2]
    kv.free(b)


def test_eviction_takes_the_oldest_freed_sequence_first():
    pool = BlockPool(6)
    kv = KVCacheManager(pool, BS)
    pa, pb = [1] * 8 + [0], [2] * 8 + [0]  # 2 hashed blocks + a partial one each
    a, b = make_seq(pa, "a"), make_seq(pb, "b")
    prefill(kv, a)
    prefill(kv, b)
    table_a, table_b = list(a.block_table), list(b.block_table)
    kv.free(a)  # a is freed first: least recently used
    kv.free(b)
    assert pool.num_cached == 4
    held = pool.allocate(3)  # a's three blocks go first, tail first
    assert held == table_a[::-1]
    assert set(pool.free) == set(table_b)
    assert attach_prefix(kv, make_seq(pa, "a2")) == 0  # a's content is gone
    b2 = make_seq(pb, "b2")
    assert attach_prefix(kv, b2) == 8  # b's survives
    kv.free(b2)
    pool.release(held)
    assert pool.num_free == 6


def test_reused_block_moves_to_the_recent_end():
    """A cached block that gets a hit and is freed again is evicted after blocks freed before it."""
    pool = BlockPool(6)
    kv = KVCacheManager(pool, BS)
    pa, pb = [1] * 4 + [0], [2] * 4 + [0]
    a, b = make_seq(pa, "a"), make_seq(pb, "b")
    prefill(kv, a)
    prefill(kv, b)
    kv.free(a)
    kv.free(b)
    a2 = make_seq(pa, "a2")
    assert attach_prefix(kv, a2) == 4  # a's block becomes the most recently used
    kv.free(a2)
    pool.allocate(4)  # the two never-used blocks + two partial ones: no cached block touched yet
    assert pool.num_cached == 2
    pool.allocate(1)  # now b's block (freed before a's was freed again) is evicted
    assert attach_prefix(kv, make_seq(pb, "b2")) == 0
    a3 = make_seq(pa, "a3")
    assert attach_prefix(kv, a3) == 4
