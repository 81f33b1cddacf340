"""Builders for the ragged batches the kernel tests share: dense per-sequence K/V plus their paged layout."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    keys: list[torch.Tensor]  # dense [ctx, Hkv, D] per sequence: what the cache holds for it
    values: list[torch.Tensor]

    @property
    def scale(self) -> float:
        return self.query.shape[-1] ** -0.5

    def args(self) -> tuple:
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)


def mixed_specs(seed: int, n_random: int = 3, max_len: int = 100) -> list[tuple[int, int]]:
    """(cached tokens, new query tokens) per sequence: fixed edge cases plus a few seeded random ones.

    Fixed: decodes at context 1, 16 and 100; a fresh prefill; chunks continuing after cached tokens whose
    boundaries fall inside a block (21 + 30) and on one (64 + 36); a two-token chunk.
    """
    specs = [(0, 1), (99, 1), (0, 37), (21, 30), (64, 36), (15, 1), (5, 2)]
    g = torch.Generator().manual_seed(seed)
    for _ in range(n_random):
        ctx = int(torch.randint(1, max_len + 1, (1,), generator=g))
        q_len = 1 if torch.rand(1, generator=g) < 0.5 else int(torch.randint(1, ctx + 1, (1,), generator=g))
        specs.append((ctx - q_len, q_len))
    return specs


def paged_batch(
    specs: list[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> PagedBatch:
    """Random Q/K/V placed in shuffled cache blocks; unused blocks and slots hold large garbage."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [-(-(c + q) // block_size) for c, q in specs]
    max_blocks = max(n_blocks) + 2  # extra columns: the kernels must not read past a sequence's own blocks
    total_blocks = sum(n_blocks) + 4
    # K and V share one allocation, as in the engine's kv_caches[layer] = [2, num_blocks, ...].
    kv = 100 * torch.randn(2, total_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(total_blocks, generator=g)
    tables = torch.zeros(len(specs), max_blocks, dtype=torch.int32)
    keys, values, used = [], [], 0
    for b, ((cached, q_len), nb) in enumerate(zip(specs, n_blocks)):
        ctx = cached + q_len
        phys = perm[used:used + nb]
        used += nb
        tables[b, :nb] = phys.to(torch.int32)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        pos = torch.arange(ctx)
        kv[0, phys[pos // block_size], pos % block_size] = k
        kv[1, phys[pos // block_size], pos % block_size] = v
        keys.append(k.to(dtype))
        values.append(v.to(dtype))
    q_lens = torch.tensor([q for _, q in specs])
    query = torch.randn(int(q_lens.sum()), num_kv_heads * group, head_dim, generator=g)
    kv = kv.to(dtype)
    return PagedBatch(
        query=query.to(dtype),
        k_cache=kv[0],
        v_cache=kv[1],
        block_tables=tables,
        seq_lens=torch.tensor([c + q for c, q in specs], dtype=torch.int32),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32),
        keys=keys,
        values=values,
    )


def varlen_batch(lengths: list[int], num_heads: int, head_dim: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(query, key, value, cu_seqlens) for sequences of `lengths` packed back to back."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, num_heads, head_dim, generator=g) for _ in range(3))
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return q, k, v, cu


def seeded_lengths(seed: int, n: int, low: int, high: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=g).tolist()
