"""Attention ops used by the engine. Each op: Triton kernel (CUDA), torch reference (CPU), and for CPU paged
decode attention a C++ kernel compiled on first use.

`TANDEM_KERNELS=torch|triton|cpp|auto` overrides the choice (auto: Triton on CUDA tensors, C++ decode on CPU).
"""
from kernels.dispatch import paged_attention, prepare, varlen_attention, write_kv_cache

__all__ = ["paged_attention", "prepare", "varlen_attention", "write_kv_cache"]
