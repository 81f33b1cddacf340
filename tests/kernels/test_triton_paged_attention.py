"""Triton paged attention against the torch reference on ragged batches of decodes and prefill chunks."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton_paged_attention import paged_attention
from tests.kernels.batches import mixed_specs, paged_batch


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3])
def test_mixed_decode_and_prefill_chunks(block_size: int, group: int) -> None:
    specs = mixed_specs(seed=10 * block_size + group)
    batch = paged_batch(specs, block_size, num_kv_heads=2, group=group, head_dim=32, seed=block_size + group)
    got = paged_attention(*batch.args())
    torch.testing.assert_close(got, reference.paged_attention(*batch.args()), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size,group", [(16, 3), (32, 1)])
def test_decode_only_batch(block_size: int, group: int) -> None:
    """All decodes: the launch takes the one-token-per-tile path."""
    specs = [(ctx - 1, 1) for ctx in (1, 2, 16, 17, 33, 64, 100)]
    batch = paged_batch(specs, block_size, num_kv_heads=2, group=group, head_dim=16, seed=7)
    got = paged_attention(*batch.args())
    torch.testing.assert_close(got, reference.paged_attention(*batch.args()), atol=1e-4, rtol=1e-4)


def test_odd_head_dim_and_empty_sequence() -> None:
    """head_dim 24 pads the tile; a sequence with no tokens this step is skipped, its neighbours are not."""
    specs = [(10, 5), (40, 0), (0, 1), (31, 20)]
    batch = paged_batch(specs, block_size=16, num_kv_heads=1, group=3, head_dim=24, seed=5)
    got = paged_attention(*batch.args())
    torch.testing.assert_close(got, reference.paged_attention(*batch.args()), atol=1e-4, rtol=1e-4)


def test_fp16_inputs_give_fp16_output() -> None:
    specs = [(0, 1), (21, 30), (47, 1)]
    batch = paged_batch(specs, block_size=16, num_kv_heads=2, group=3, head_dim=32, seed=2, dtype=torch.float16)
    got = paged_attention(*batch.args())
    assert got.dtype == torch.float16
    want = reference.paged_attention(*batch.args())
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
