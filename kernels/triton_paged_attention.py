"""Paged causal attention over a ragged batch of decodes and prefill chunks (Triton).

One program per (q-block, KV head). A q-block is up to BLOCK_Q query tokens of one sequence times the
query heads that share the KV head, stacked as the rows of one tile, so every K/V tile read from the cache
serves the whole GQA group. Decodes are q-blocks with one valid token: their cost is the KV read either way,
and a batch of only decodes launches with BLOCK_Q = 1 so no program carries padding token rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import compute_mode, find_seq, num_q_blocks

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # rows per token in a tile (power of two >= GROUP)
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = local_block * BLOCK_Q + rows // GROUP_PAD  # index within this sequence's query tokens
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = ctx_len - q_len + tok  # absolute position: causal limit of each row
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q_off = (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1e30, dtype=tl.float32)  # finite: padding rows never produce NaN
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    # Keys past the last valid row's position are masked for every row, so they are never read.
    last_tok = tl.minimum(q_len, (local_block + 1) * BLOCK_Q)
    kv_end = ctx_len - q_len + last_tok
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        phys = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = keys % BLOCK_SIZE
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_cache_ptr + phys[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
            + dims[None, :] * stride_kd,
            mask=kv_mask, other=0.0)
        v = tl.load(
            v_cache_ptr + phys[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
            + dims[None, :] * stride_vd,
            mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        causal = (keys[None, :] <= q_pos[:, None]) & key_ok[None, :]
        qk = tl.where(causal, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_start + tok)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _tile_shape(num_tokens: int, num_seqs: int, group: int) -> tuple[int, int]:
    """(BLOCK_Q, GROUP_PAD): at least 16 rows per tile, the smallest tensor-core MMA tile."""
    group_pad = triton.next_power_of_2(group)
    if num_tokens <= num_seqs:  # all decodes (or near enough: BLOCK_Q = 1 is correct for any batch)
        return 1, max(16, group_pad)
    return max(1, 64 // group_pad), group_pad


def launch_plan(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, out: torch.Tensor,
) -> tuple[tuple[int, int], tuple, dict[str, object]]:
    """(grid, runtime args, compile-time args) of the launch; also used by the offline GPU compile check."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    block_q, group_pad = _tile_shape(num_tokens, num_seqs, group)
    upcast, precision = compute_mode(query)
    meta = dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=max(64, block_size), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        UPCAST=upcast, DOT_PRECISION=precision,
    )
    args = (
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, num_seqs, scale * _LOG2E,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), block_tables.stride(0),
    )
    return (num_q_blocks(num_tokens, num_seqs, block_q), num_kv_heads), args, meta


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float,
) -> torch.Tensor:
    """Same contract as `kernels.reference.paged_attention`."""
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    out = torch.empty_like(query)
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    grid, args, meta = launch_plan(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out)
    _paged_attention_kernel[grid](*args, **meta)
    return out
