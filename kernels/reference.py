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
    checked: bool = False,  # the caller knows no slot is -1 (kernels/paged.py looks once per step, not per layer)
) -> None:
    """Scatter each token's K/V into its cache slot, in place."""
    if slot_mapping.numel() == 0:
        return
    if not checked and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    # The cache viewed as one row per slot: a single index_copy_ instead of advanced-index assignment.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The blocks named by `tables` [B, n] as [B, n * block_size, Hkv, D].

    index_select over the cache viewed as one row per block copies whole blocks (a memcpy each); indexing the
    4-d cache directly goes element by element and was the largest cost of a CPU decode step.
    """
    num_blocks, block_size = cache.shape[:2]
    rows = cache.view(num_blocks, -1).index_select(0, tables.reshape(-1).long())
    return rows.view(tables.shape[0], tables.shape[1] * block_size, *cache.shape[2:])


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence as [length, Hkv, D]."""
    n_blocks = (length + cache.shape[1] - 1) // cache.shape[1]
    return _gather_blocks(cache, block_table[None, :n_blocks])[0, :length]


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length after this step (cached + new tokens)
    query_start_loc: torch.Tensor,  # [B + 1] int32: offsets of each sequence's tokens in `query`
    scale: float,
    window: int = 0,  # > 0: a query at position p attends only to positions p - window + 1 .. p (sliding window)
    softcap: float = 0.0,  # > 0: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2)
) -> torch.Tensor:
    """Causal attention for a ragged batch mixing decodes (1 query token) and prefill chunks.

    Query token i of sequence b sits at absolute position seq_lens[b] - q_len[b] + i and attends to
    cache positions 0..that position (its own K/V must already be written to the cache), or only to the last
    `window` of them.
    """
    return attention_from_lists(query, k_cache, v_cache, block_tables, (query_start_loc.tolist(), seq_lens.tolist()),
                                scale, window, softcap)


def attention_from_lists(query, k_cache, v_cache, block_tables, starts_lens: tuple[list[int], list[int]],
                         scale: float, window: int = 0, softcap: float = 0.0,
                         fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """paged_attention with query_start_loc and seq_lens already read as lists (once per step, not per layer).
    `fresh_kv`: the step's own key and value rows [T, Hkv, D] (those just written), for `prefill_attention`."""
    starts, lens = starts_lens
    out = torch.empty_like(query)
    decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    if decodes:
        _decode_attention(query, k_cache, v_cache, block_tables, starts, lens, decodes, scale, out, window, softcap)
    prefill_attention(query, k_cache, v_cache, block_tables, starts, lens, scale, out, window, softcap, fresh_kv)
    return out


def _attend(q, k, v, mask, scale: float, softcap: float, is_causal: bool = False) -> torch.Tensor:
    """SDPA, or with a soft-cap the same arithmetic written out (scores * scale, cap, mask, softmax, @ v)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v)


def prefill_attention(query, k_cache, v_cache, block_tables, starts: list[int], lens: list[int], scale: float,
                      out: torch.Tensor, window: int = 0, softcap: float = 0.0,
                      fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Fills `out` for every sequence with more than one query token (prefill chunks), causal by position.

    `fresh_kv` (the step's key and value rows [T, Hkv, D], as written to the cache): a chunk that is its sequence's
    whole context attends to its own rows in place, with SDPA's grouped-query heads, instead of gathering them back
    from the cache and repeating the KV heads (the same values where the cache keeps the query's dtype; the two
    copies were ~5% of a 512-token prefill's attention)."""
    n_heads, n_kv = query.shape[1], k_cache.shape[2]
    fresh = fresh_kv is not None and k_cache.dtype == query.dtype and not softcap
    for b, ctx in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        q_len = q1 - q0
        if q_len <= 1:
            continue
        if fresh and ctx == q_len and not (0 < window < ctx):
            q = query[q0:q1].transpose(0, 1)[None]
            k, v = (t[q0:q1].transpose(0, 1)[None] for t in fresh_kv)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=n_heads != n_kv)
            out[q0:q1] = o[0].transpose(0, 1)
            continue
        # 4-d [1, heads, tokens, D] inputs: SDPA's fused CPU kernel takes only those (3-d fell back to the math
        # path, 3-4x slower on long prompts). KV heads are repeated for GQA (enable_gqa is slower on CPU).
        group = n_heads // n_kv
        k, v = (_gather_context(c, block_tables[b], ctx).transpose(0, 1).to(query.dtype) for c in (k_cache, v_cache))
        if group > 1:
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        q = query[q0:q1].transpose(0, 1)[None]
        if ctx == q_len and not (0 < window < ctx):  # the whole prompt in this chunk: plain causal
            o = _attend(q, k[None], v[None], None, scale, softcap, is_causal=True)
        else:  # a later chunk attends to everything cached before it, then causally within itself
            q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
            k_pos = torch.arange(ctx, device=query.device)[None, :]
            mask = k_pos <= q_pos[:, None]
            if window > 0:
                mask &= k_pos > q_pos[:, None] - window
            o = _attend(q, k[None], v[None], mask, scale, softcap)
        out[q0:q1] = o[0].transpose(0, 1)


# Decodes are sorted by context length and attended in groups of this many, each padded only to its own
# longest context: one call per group, far less padding than one call padded to the batch's longest.
_DECODE_GROUP = 32


def _decode_attention(query, k_cache, v_cache, block_tables, starts, lens, decodes, scale, out, window: int = 0,
                      softcap: float = 0.0) -> None:
    """All one-token sequences, in groups of similar context length: gather, mask the padding, one SDPA call."""
    decodes = sorted(decodes, key=lambda b: lens[b])
    for i in range(0, len(decodes), _DECODE_GROUP):
        _decode_group(query, k_cache, v_cache, block_tables, starts, lens, decodes[i:i + _DECODE_GROUP], scale, out,
                      window, softcap)


def _decode_group(query, k_cache, v_cache, block_tables, starts, lens, group, scale, out, window: int = 0,
                  softcap: float = 0.0) -> None:
    block_size = k_cache.shape[1]
    dev = query.device
    ctx = torch.tensor([lens[b] for b in group], device=dev)
    max_ctx = lens[group[-1]]
    n_blocks = (max_ctx + block_size - 1) // block_size
    tables = block_tables[torch.tensor(group, device=dev), :n_blocks]  # [G, n_blocks]
    k = _gather_blocks(k_cache, tables)[:, :max_ctx]  # [G, max_ctx, Hkv, D]
    v = _gather_blocks(v_cache, tables)[:, :max_ctx]
    rows = torch.tensor([starts[b] for b in group], device=dev)
    q = query[rows]  # [G, Hq, D]
    n_kv = k.shape[2]
    k_pos = torch.arange(max_ctx, device=dev)[None, :]
    mask = k_pos < ctx[:, None]  # [G, max_ctx]
    if window > 0:
        mask &= k_pos >= ctx[:, None] - window
    o = _attend(
        q.view(q.shape[0], n_kv, -1, q.shape[-1]),  # the query heads of a KV head act as its query rows
        k.transpose(1, 2).to(q.dtype),
        v.transpose(1, 2).to(q.dtype),
        mask[:, None, None, :],
        scale, softcap,
    )
    out[rows] = o.reshape(q.shape)


# A lone pair longer than this goes through SDPA's fused kernel (1.5x faster at 400 tokens, about even at 256 on CPU).
_FUSED_VARLEN_MIN = 256
# Consecutive pairs at least this fraction of their group's longest attend in one SDPA call, padded to that longest
# (keys masked): one call per group instead of one per pair. Callers that sort pairs longest first (the
# cross-encoder does) get tight groups; pairs of one length need no padding and no copies at all.
_GROUP_MIN_FILL = 0.75


def varlen_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, H, D]
    value: torch.Tensor,  # [T, H, D]
    cu_seqlens: torch.Tensor,  # [B + 1] int32
    scale: float,
) -> torch.Tensor:
    """Bidirectional attention inside each packed sequence (cross-encoder pairs), no attention across them."""
    return _varlen(query, key, value, None, cu_seqlens, scale)


def varlen_attention_qkv(qkv: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """`varlen_attention` of the queries, keys and values packed side by side in one tensor [T, 3, H, D] (one
    projection's output): a padded group gathers its rows once from it, not once per q, k and v."""
    query, key, value = qkv.unbind(1)
    return _varlen(query, key, value, qkv.view(qkv.shape[0], -1) if qkv.is_contiguous() else None, cu_seqlens,
                   scale)


def _varlen(query, key, value, packed: torch.Tensor | None, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """`packed`: q, k and v as one [T, 3 * H * D] tensor whose rows hold each token's three, or None."""
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    i = 0
    while i < len(lens):
        longest, j = lens[i], i + 1
        while j < len(lens) and _GROUP_MIN_FILL * longest <= lens[j] <= longest:
            j += 1
        if j - i == 1:
            _attend_one(query, key, value, bounds[i], bounds[i + 1], scale, out)
        else:
            _attend_group(query, key, value, packed, bounds[i:j + 1], lens[i:j], scale, out)
        i = j
    return out


def _attend_one(query, key, value, s: int, e: int, scale: float, out: torch.Tensor) -> None:
    if e == s:
        return
    q, k, v = (t[s:e].transpose(0, 1) for t in (query, key, value))
    if e - s > _FUSED_VARLEN_MIN:
        out[s:e] = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale)[0].transpose(0, 1)
        return
    # Plain batched matmuls and softmax: up to ~256 tokens this beats SDPA's fused CPU kernel (whose per-call
    # cost dominates short pairs), and agrees with it to float rounding.
    scores = torch.baddbmm(q.new_empty(q.shape[0], e - s, e - s), q, k.transpose(1, 2), beta=0, alpha=scale)
    out[s:e] = torch.bmm(scores.softmax(-1), v).transpose(0, 1)


def _attend_group(query, key, value, packed: torch.Tensor | None, bounds: list[int], lens: list[int], scale: float,
                  out: torch.Tensor) -> None:
    """Pairs bounds[0]..bounds[-1] (lengths `lens`, the first the longest) in one SDPA call, [G, H, longest, D]."""
    s, e = bounds[0], bounds[-1]
    g, longest, (heads, dim) = len(lens), lens[0], query.shape[1:]
    if all(n == longest for n in lens):  # one length: the packed rows already are [G, L, H, D], a view
        q, k, v = (t[s:e].view(g, longest, heads, dim).transpose(1, 2) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, scale=scale)
        out[s:e] = o.transpose(1, 2).reshape(e - s, heads, dim)
        return
    dev = query.device
    offsets = torch.arange(longest, device=dev)
    n = torch.tensor(lens, device=dev)
    real = offsets[None, :] < n[:, None]  # [G, longest]
    # Row of each padded slot; padding slots read the group's first row (masked as keys, dropped as queries).
    rows = torch.where(real, torch.tensor(bounds[:-1], device=dev)[:, None] + offsets[None, :], s).reshape(-1)
    if packed is not None:  # one gather of whole rows (q, k and v side by side), then views
        q, k, v = packed.index_select(0, rows).view(g, longest, 3, heads, dim).transpose(1, 3).unbind(2)
    else:
        q, k, v = (t.index_select(0, rows).view(g, longest, heads, dim).transpose(1, 2) for t in (query, key, value))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=real[:, None, None, :], scale=scale)
    # The real rows straight into `out` (SDPA's CPU output is [G, longest, H, D] underneath: the reshape is a view).
    torch.index_select(o.transpose(1, 2).reshape(g * longest, heads, dim), 0, real.reshape(-1).nonzero()[:, 0],
                       out=out[s:e])
