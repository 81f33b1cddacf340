"""The torch references against dense scaled_dot_product_attention, which nobody here wrote."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from tests.kernels.batches import mixed_specs, paged_batch, seeded_lengths, varlen_batch


@pytest.mark.parametrize("block_size,group", [(16, 1), (32, 3)])
def test_paged_reference_matches_dense_sdpa(block_size: int, group: int) -> None:
    specs = mixed_specs(seed=block_size + group)
    batch = paged_batch(specs, block_size, num_kv_heads=2, group=group, head_dim=16, seed=1)
    got = reference.paged_attention(*batch.args())

    starts = batch.query_start_loc.tolist()
    for b, (cached, q_len) in enumerate(specs):
        q = batch.query[starts[b]:starts[b + 1]].transpose(0, 1)  # [Hq, q_len, D]
        k = batch.keys[b].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        v = batch.values[b].repeat_interleave(group, dim=1).transpose(0, 1)
        # Query row i sits at absolute position cached + i: bottom-right aligned causal mask.
        mask = torch.ones(q_len, cached + q_len, dtype=torch.bool).tril(diagonal=cached)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=batch.scale).transpose(0, 1)
        torch.testing.assert_close(got[starts[b]:starts[b + 1]], want, atol=1e-5, rtol=1e-5)


def test_varlen_reference_matches_block_diagonal_sdpa() -> None:
    lengths = [1, 64, 300] + seeded_lengths(seed=3, n=4, low=1, high=64)  # 300: the fused-kernel branch
    q, k, v, cu = varlen_batch(lengths, num_heads=2, head_dim=32)
    got = reference.varlen_attention(q, k, v, cu, 0.3)

    # One dense call over the whole packed batch; the block-diagonal mask keeps sequences apart.
    seq_id = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = seq_id[:, None] == seq_id[None, :]
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.3).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _block_diagonal_sdpa(q, k, v, lengths: list[int], scale: float) -> torch.Tensor:
    seq_id = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = seq_id[:, None] == seq_id[None, :]
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale).transpose(0, 1)


def test_varlen_reference_groups_match_block_diagonal_sdpa() -> None:
    # Longest first, as the cross-encoder packs them: runs of one length (a view, no padding), runs within
    # _GROUP_MIN_FILL of their longest (padded, keys masked), and lone pairs on either side of _FUSED_VARLEN_MIN.
    lengths = [420, 300, 300, 300, 200, 120, 64, 64, 60, 17, 3, 1, 1]
    q, k, v, cu = varlen_batch(lengths, num_heads=3, head_dim=32, seed=5)
    got = reference.varlen_attention(q, k, v, cu, 0.2)
    torch.testing.assert_close(got, _block_diagonal_sdpa(q, k, v, lengths, 0.2), atol=1e-5, rtol=1e-5)



def test_varlen_reference_of_packed_qkv_matches_block_diagonal_sdpa_and_the_separate_tensors() -> None:
    # One projection's output [T, 3, H, D], as the encoder makes it: padded groups gather rows of it once.
    lengths = [420, 300, 300, 300, 262, 250, 241, 230, 200, 120, 64, 64, 60, 17, 3, 1, 1]
    q, k, v, cu = varlen_batch(lengths, num_heads=3, head_dim=32, seed=6)
    qkv = torch.stack([q, k, v], dim=1)
    got = reference.varlen_attention_qkv(qkv, cu, 0.2)
    torch.testing.assert_close(got, _block_diagonal_sdpa(q, k, v, lengths, 0.2), atol=1e-5, rtol=1e-5)
    separate = reference.varlen_attention(*qkv.unbind(1), cu, 0.2)
    torch.testing.assert_close(got, separate, atol=1e-6, rtol=1e-6)
    # a qkv that is not one contiguous block (a slice of a wider tensor) takes the separate gathers, same values
    wide = torch.cat([qkv, torch.zeros(qkv.shape[0], 1, *qkv.shape[2:])], dim=1)[:, :3]
    assert not wide.is_contiguous()
    torch.testing.assert_close(reference.varlen_attention_qkv(wide, cu, 0.2), separate, atol=1e-6, rtol=1e-6)

def test_write_kv_cache_reference_matches_per_token_copy() -> None:
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 9, 2, 16, generator=g)
    slots = torch.tensor([5, -1, 40, 16, 17, -1, 0, 63, 31])
    k_cache, v_cache = torch.zeros(2, 4, 16, 2, 16)
    reference.write_kv_cache(key, value, k_cache, v_cache, slots)

    want_k, want_v = torch.zeros(2, 4, 16, 2, 16)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // 16, s % 16] = key[t]
            want_v[s // 16, s % 16] = value[t]
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


@pytest.mark.parametrize("window,softcap", [(16, 0.0), (5, 0.0), (1, 0.0), (0, 50.0), (16, 30.0)])
def test_paged_reference_sliding_window_and_softcap_match_dense(window: int, softcap: float) -> None:
    """A query at position p sees positions p - window + 1 .. p (transformers' sliding_window_overlay:
    kv_idx > q_idx - window); soft-capped scores are cap * tanh(s / cap) before the softmax (Gemma 2's eager path)."""
    specs = mixed_specs(seed=window + 3, n_random=4)
    batch = paged_batch(specs, 16, num_kv_heads=2, group=2, head_dim=16, seed=2)
    got = reference.paged_attention(*batch.args(), window=window, softcap=softcap)
    starts = batch.query_start_loc.tolist()
    for b, (cached, q_len) in enumerate(specs):
        q = batch.query[starts[b]:starts[b + 1]].transpose(0, 1)
        k = batch.keys[b].repeat_interleave(2, dim=1).transpose(0, 1)
        v = batch.values[b].repeat_interleave(2, dim=1).transpose(0, 1)
        q_pos = torch.arange(cached, cached + q_len)[:, None]
        k_pos = torch.arange(cached + q_len)[None, :]
        mask = k_pos <= q_pos
        if window:
            mask &= k_pos > q_pos - window
        scores = (q @ k.transpose(1, 2)) * batch.scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        want = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        torch.testing.assert_close(got[starts[b]:starts[b + 1]], want.transpose(0, 1), atol=1e-4, rtol=1e-4)
