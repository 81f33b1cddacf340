"""Bidirectional attention inside each packed sequence of a ragged batch (Triton).

One program per (q-block, head); each q-block streams every key of its own sequence once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import compute_mode, find_seq, num_q_blocks

_LOG2E = 1.4426950408889634


@triton.jit
def _varlen_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_ptr,
    num_seqs, qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = find_seq(cu_seqlens_ptr, q_block, num_seqs, BLOCK_M)
    start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - start
    local_block = q_block - (start // BLOCK_M + seq)
    if local_block * BLOCK_M >= seq_len:
        return

    rows = local_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_len
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q_off = (start + rows)[:, None].to(tl.int64) * stride_qt + head * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for kv_start in range(0, seq_len, BLOCK_N):
        keys = kv_start + tl.arange(0, BLOCK_N)
        key_ok = keys < seq_len
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        tok = (start + keys)[:, None].to(tl.int64)
        k = tl.load(k_ptr + tok * stride_kt + head * stride_kh + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + tok * stride_vt + head * stride_vh + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(key_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_off = (start + rows)[:, None].to(tl.int64) * stride_ot + head * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def launch_plan(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
    out: torch.Tensor,
) -> tuple[tuple[int, int], tuple, dict[str, object]]:
    """(grid, runtime args, compile-time args) of the launch; also used by the offline GPU compile check."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = cu_seqlens.shape[0] - 1
    upcast, precision = compute_mode(query)
    meta = dict(
        BLOCK_M=64, BLOCK_N=64, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        UPCAST=upcast, DOT_PRECISION=precision,
    )
    args = (
        query, key, value, out, cu_seqlens, num_seqs, scale * _LOG2E,
        *query.stride(), *key.stride(), *value.stride(), *out.stride(),
    )
    return (num_q_blocks(num_tokens, num_seqs, meta["BLOCK_M"]), num_heads), args, meta


def varlen_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, H, D]
    value: torch.Tensor,  # [T, H, D]
    cu_seqlens: torch.Tensor,  # [B + 1] int32
    scale: float,
) -> torch.Tensor:
    """Same contract as `kernels.reference.varlen_attention`."""
    out = torch.empty_like(query)
    if query.shape[0] == 0 or cu_seqlens.shape[0] <= 1:
        return out
    grid, args, meta = launch_plan(query, key, value, cu_seqlens, scale, out)
    _varlen_attention_kernel[grid](*args, **meta)
    return out
