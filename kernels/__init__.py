"""Attention ops used by the engine. Each op: Triton kernel (CUDA), torch reference (CPU).

`TANDEM_KERNELS=torch|triton|auto` overrides the choice (auto: Triton on CUDA tensors).
"""
from kernels.dispatch import paged_attention, varlen_attention, write_kv_cache

__all__ = ["paged_attention", "varlen_attention", "write_kv_cache"]
