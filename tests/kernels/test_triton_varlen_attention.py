"""Triton varlen (bidirectional, cu_seqlens) attention against the torch reference."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton_varlen_attention import varlen_attention
from tests.kernels.batches import seeded_lengths, varlen_batch


@pytest.mark.parametrize(
    "lengths,num_heads,head_dim",
    [
        ([1, 64, 7, 33, 16, 50], 2, 32),
        (seeded_lengths(seed=11, n=6, low=1, high=64), 3, 16),
        ([5, 0, 65, 1], 1, 16),  # an empty pair, and one spilling one token into a second q-block
    ],
)
def test_matches_reference(lengths: list[int], num_heads: int, head_dim: int) -> None:
    q, k, v, cu = varlen_batch(lengths, num_heads, head_dim, seed=len(lengths))
    got = varlen_attention(q, k, v, cu, head_dim ** -0.5)
    want = reference.varlen_attention(q, k, v, cu, head_dim ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
