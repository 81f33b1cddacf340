"""Pick the implementation per call: Triton for CUDA tensors, the torch reference otherwise.

`TANDEM_KERNELS=torch|triton|auto` (default auto) overrides the choice; it is read on every call so tests
and benchmarks can switch it. Triton modules are imported on first use, so CPU-only runs never load them.
"""
from __future__ import annotations

import os
from typing import Protocol

import torch

from kernels import reference

MODES = ("torch", "triton", "auto")


class _HasDevice(Protocol):
    is_cuda: bool


def backend(t: _HasDevice) -> str:
    """"torch" or "triton" for an op whose main input is `t`, per TANDEM_KERNELS."""
    mode = os.environ.get("TANDEM_KERNELS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"TANDEM_KERNELS={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "auto":
        return "triton" if t.is_cuda else "torch"
    if mode == "triton" and not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("TANDEM_KERNELS=triton needs CUDA tensors (or TRITON_INTERPRET=1 to interpret on CPU)")
    return mode


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if backend(k_cache) == "triton":
        from kernels.triton_kv_cache import write_kv_cache as op
    else:
        op = reference.write_kv_cache
    op(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
) -> torch.Tensor:
    if backend(query) == "triton":
        from kernels.triton_paged_attention import paged_attention as op
    else:
        op = reference.paged_attention
    return op(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def varlen_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
) -> torch.Tensor:
    if backend(query) == "triton":
        from kernels.triton_varlen_attention import varlen_attention as op
    else:
        op = reference.varlen_attention
    return op(query, key, value, cu_seqlens, scale)
