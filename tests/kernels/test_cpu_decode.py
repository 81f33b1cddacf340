"""The C++ CPU decode kernel against the torch reference (itself checked against dense SDPA)."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode, reference
from tests.kernels.batches import mixed_specs, paged_batch


def test_the_kernel_builds_here() -> None:
    # The test machines have g++ and ninja; a build failure here is a real regression, not a skip.
    assert cpu_decode.available()


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3])
def test_mixed_decode_and_prefill_chunks(block_size: int, group: int) -> None:
    specs = mixed_specs(seed=10 * block_size + group, n_random=6)
    batch = paged_batch(specs, block_size, num_kv_heads=2, group=group, head_dim=32, seed=block_size + group)
    got = cpu_decode.paged_attention(*batch.args())
    torch.testing.assert_close(got, reference.paged_attention(*batch.args()), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size,group", [(16, 3), (32, 1)])
def test_decode_only_batch_lengths_1_to_100(block_size: int, group: int) -> None:
    specs = [(ctx - 1, 1) for ctx in (1, 2, 15, 16, 17, 31, 32, 33, 64, 99, 100)]
    batch = paged_batch(specs, block_size, num_kv_heads=3, group=group, head_dim=64, seed=7)
    got = cpu_decode.paged_attention(*batch.args())
    torch.testing.assert_close(got, reference.paged_attention(*batch.args()), atol=1e-4, rtol=1e-4)


def test_non_float32_is_refused() -> None:
    batch = paged_batch([(3, 1)], block_size=16, num_kv_heads=1, group=1, head_dim=16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_decode.paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                                          batch.seq_lens, batch.scale)
