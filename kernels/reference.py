"""Pure-torch reference ops. The Triton kernels must match these; on CPU they are the fast path too."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, slot = block * block_size + offset; -1 = skip
) -> None:
    """Scatter each token's K/V into its cache slot, in place."""
    if slot_mapping.numel() == 0:
        return
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    # The cache viewed as one row per slot: a single index_copy_ instead of advanced-index assignment.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence as [length, Hkv, D]."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:n_blocks].long()].flatten(0, 1)[:length]


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length after this step (cached + new tokens)
    query_start_loc: torch.Tensor,  # [B + 1] int32: offsets of each sequence's tokens in `query`
    scale: float,
) -> torch.Tensor:
    """Causal attention for a ragged batch mixing decodes (1 query token) and prefill chunks.

    Query token i of sequence b sits at absolute position seq_lens[b] - q_len[b] + i and attends to
    cache positions 0..that position (its own K/V must already be written to the cache).
    """
    out = torch.empty_like(query)
    n_heads, n_kv = query.shape[1], k_cache.shape[2]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    if decodes:
        _decode_attention(query, k_cache, v_cache, block_tables, starts, lens, decodes, scale, out)
    for b, ctx in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        q_len = q1 - q0
        if q_len <= 1:
            continue
        k = _gather_context(k_cache, block_tables[b], ctx).transpose(0, 1)  # [Hkv, ctx, D]
        v = _gather_context(v_cache, block_tables[b], ctx).transpose(0, 1)
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
        mask = torch.arange(ctx, device=query.device)[None, :] <= q_pos[:, None]
        # GQA without enable_gqa (slow on CPU): the heads sharing a KV head are folded into the query axis.
        group = n_heads // n_kv
        q = query[q0:q1].transpose(0, 1).reshape(n_kv, group * q_len, -1)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask.repeat(group, 1),
                                           scale=scale)
        out[q0:q1] = o.view(n_heads, q_len, -1).transpose(0, 1)
    return out


def _decode_attention(query, k_cache, v_cache, block_tables, starts, lens, decodes, scale, out) -> None:
    """All one-token sequences at once: gather their contexts padded to the longest, mask the rest."""
    block_size = k_cache.shape[1]
    idx = torch.tensor(decodes, device=query.device)
    ctx = torch.tensor([lens[b] for b in decodes], device=query.device)
    max_ctx = int(ctx.max())
    n_blocks = (max_ctx + block_size - 1) // block_size
    tables = block_tables[idx, :n_blocks].long()  # [Bd, n_blocks]
    k = k_cache[tables].flatten(1, 2)[:, :max_ctx]  # [Bd, max_ctx, Hkv, D]
    v = v_cache[tables].flatten(1, 2)[:, :max_ctx]
    rows = torch.tensor([starts[b] for b in decodes], device=query.device)
    q = query[rows]  # [Bd, Hq, D]
    n_kv = k.shape[2]
    mask = torch.arange(max_ctx, device=query.device)[None, :] < ctx[:, None]  # [Bd, max_ctx]
    o = F.scaled_dot_product_attention(
        q.view(q.shape[0], n_kv, -1, q.shape[-1]),  # the query heads of a KV head act as its query rows
        k.transpose(1, 2).to(q.dtype),
        v.transpose(1, 2).to(q.dtype),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )
    out[rows] = o.reshape(q.shape)


def varlen_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, H, D]
    value: torch.Tensor,  # [T, H, D]
    cu_seqlens: torch.Tensor,  # [B + 1] int32
    scale: float,
) -> torch.Tensor:
    """Bidirectional attention inside each packed sequence (cross-encoder pairs), no padding."""
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        q, k, v = (t[s:e].transpose(0, 1) for t in (query, key, value))
        out[s:e] = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1)
    return out
