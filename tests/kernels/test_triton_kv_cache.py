"""Triton KV-cache write against the torch reference, with skipped (-1) slots."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton_kv_cache import write_kv_cache


@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference_and_skips_negative_slots(block_size: int) -> None:
    g = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, tokens = 5, 3, 16, 12
    key = torch.randn(tokens, num_kv_heads, head_dim, generator=g)
    value = torch.randn(tokens, num_kv_heads, head_dim, generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[[1, 4, 11]] = -1
    before = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    got, want = before.clone(), before.clone()

    write_kv_cache(key, value, got[0], got[1], slots)
    reference.write_kv_cache(key, value, want[0], want[1], slots)

    assert torch.equal(got, want)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat = got.flatten(1, 2)  # [2, slots, Hkv, D]
    assert torch.equal(flat[:, ~written], before.flatten(1, 2)[:, ~written])


def test_casts_to_cache_dtype() -> None:
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 4, 2, 32, generator=g)
    slots = torch.tensor([3, -1, 16, 30])
    got, want = torch.zeros(2, 2, 2, 16, 2, 32, dtype=torch.float16)
    write_kv_cache(key, value, got[0], got[1], slots)
    reference.write_kv_cache(key, value, want[0], want[1], slots)
    assert torch.equal(got, want)
