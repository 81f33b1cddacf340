"""Paged attention as a model layer calls it: write this step's K/V into the cache, then attend.

A forward runs the same step through every layer, so what is the same for all layers is decided once, in `plan_step`:
the backend (from the model's kernel mode, TANDEM_KERNELS read once at start-up), whether the step is decode-only, the
query offsets and context lengths as Python lists (CPU), and which rows have a cache slot. On a small CPU decode
step those per-layer decisions, not arithmetic, were most of the time outside the matmuls (30 layers x a dozen
small torch ops and list conversions). `write_and_attend` then does one layer's work with them: on float32 CPU,
a decode-only step is one C++ call per layer (write K/V, attend); a mixed step writes in C++ and sends its decodes
to the C++ kernel and its prefill chunks to the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_decode, reference
from kernels.dispatch import backend, cpp_usable, triton_refuses


@dataclass(frozen=True, slots=True)
class PagedPlan:
    """One forward's paged-attention inputs and the choices every layer shares."""
    slot_mapping: torch.Tensor  # [T] int64, -1 = write nothing
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    query_start_loc: torch.Tensor  # [B + 1] int32
    backend: str  # "triton", "cpp" (float32 CPU with the C++ kernels built) or "torch"
    decode_only: bool  # every sequence has one query token (known on CPU; False on CUDA, where nothing reads it)
    starts: list[int] | None  # query_start_loc as a list: CPU backends, mixed steps (None otherwise)
    lens: list[int] | None  # seq_lens as a list, likewise
    # torch backend, when some slots are -1 (CUDA graph padding): the rows to write and their slots; None: all rows
    kept_rows: torch.Tensor | None = None
    kept_slots: torch.Tensor | None = None


def plan_step(slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
         query_start_loc: torch.Tensor, activations: torch.Tensor, cache: torch.Tensor,
         mode: str = "auto") -> PagedPlan:
    """The plan of a step whose hidden states look like `activations` and whose KV cache is `cache`, on the backend
    `mode` asks for (kernels/dispatch.py).

    On CUDA it reads nothing back from the device (a CUDA graph captures the forward that calls it)."""
    choice = backend(activations, mode)
    if choice == "cpp":  # the C++ kernels write and read float32 caches only
        choice = "cpp" if cpp_usable(activations, mode == "cpp", cache) else "torch"
    if choice == "triton":
        return PagedPlan(slot_mapping, block_tables, seq_lens, query_start_loc, choice, False, None, None)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    decode_only = all(b - a == 1 for a, b in zip(starts, starts[1:]))
    if choice == "cpp" and not decode_only and len(slot_mapping) <= NARROW_ROWS and not bool((slot_mapping < 0).any()):
        # A narrow mixed step (decodes beside a few prompt or pair tokens) as one row per query token: every row's K/V
        # is written before any row attends (paged_decode_qkv), so a chunk's token j attending to its first
        # `context - q + j + 1` positions is exactly causal attention, and the step takes the decode path (the C++
        # layer walker, no per-layer Python) instead of costing twice the decodes beside it.
        block_tables, seq_lens = _rows_of(starts, lens, block_tables, seq_lens.dtype)
        query_start_loc = torch.arange(len(slot_mapping) + 1, dtype=query_start_loc.dtype)
        decode_only = True
    kept_rows = kept_slots = None
    if choice == "torch" and slot_mapping.numel() and bool((slot_mapping < 0).any()):
        kept_rows = (slot_mapping >= 0).nonzero()[:, 0]
        kept_slots = slot_mapping[kept_rows]
    return PagedPlan(slot_mapping, block_tables, seq_lens, query_start_loc, choice, decode_only,
                     None if decode_only else starts, None if decode_only else lens, kept_rows, kept_slots)


# The most query tokens a mixed CPU step may have to run as decode rows (`plan_step`): the small-M kernels' widest
# narrow path (kernels/quant.py _SMALL_M); wider steps are prefill-shaped and keep the varlen path.
NARROW_ROWS = 16


def _rows_of(starts: list[int], lens: list[int], block_tables: torch.Tensor, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode row per query token: its sequence's block table and the context it attends to (causal)."""
    owners: list[int] = []
    row_lens: list[int] = []
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        q, ctx = b - a, lens[i]
        owners.extend([i] * q)
        row_lens.extend(range(ctx - q + 1, ctx + 1))
    return block_tables.index_select(0, torch.tensor(owners, dtype=torch.long)), torch.tensor(row_lens, dtype=dtype)


def write_and_attend(p: PagedPlan, qkv: torch.Tensor, num_q_heads: int, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """qkv [T, Hq + 2 Hkv, D] (q and k rotated): its K/V rows go to their slots, then its queries attend.
    Returns [T, Hq, D]. The values are those of kernels.write_kv_cache followed by kernels.paged_attention."""
    if p.backend == "cpp" and p.decode_only:
        return cpu_decode.paged_decode_qkv(qkv, num_q_heads, k_cache, v_cache, p.slot_mapping, p.block_tables,
                                           p.seq_lens, scale, window, softcap)
    num_kv = k_cache.shape[2]
    q, k, v = qkv.split([num_q_heads, num_kv, num_kv], dim=1)
    if p.backend == "triton":
        triton_refuses(window, softcap)
        from kernels.triton_kv_cache import write_kv_cache
        from kernels.triton_paged_attention import paged_attention

        write_kv_cache(k, v, k_cache, v_cache, p.slot_mapping)
        return paged_attention(q, k_cache, v_cache, p.block_tables, p.seq_lens, p.query_start_loc, scale)
    if p.backend == "cpp":
        cpu_decode.write_kv_cache(k, v, k_cache, v_cache, p.slot_mapping)
        return cpu_decode.attention_from_lists(q, k_cache, v_cache, p.block_tables, p.seq_lens, p.query_start_loc,
                                               _lists(p), scale, window, softcap, (k, v))
    if p.kept_rows is not None:
        reference.write_kv_cache(k[p.kept_rows], v[p.kept_rows], k_cache, v_cache, p.kept_slots, checked=True)
    else:
        reference.write_kv_cache(k, v, k_cache, v_cache, p.slot_mapping, checked=True)
    return reference.attention_from_lists(q, k_cache, v_cache, p.block_tables, _lists(p), scale, window, softcap,
                                          (k, v))


def _lists(p: PagedPlan) -> tuple[list[int], list[int]]:
    """(starts, lens) of the step: a decode-only plan keeps none (B sequences, one token each, from the tensor)."""
    if p.starts is not None and p.lens is not None:
        return p.starts, p.lens
    lens = p.seq_lens.tolist()
    return list(range(len(lens) + 1)), lens
