"""Attention ops used by the engine. Each op: Triton kernel (CUDA), torch reference (CPU), and for CPU paged
decode attention a C++ kernel compiled on first use.

A model layer calls `write_and_attend` with a `PagedPlan` made once per forward (`plan_step`, kernels/paged.py).
`TANDEM_KERNELS=torch|triton|cpp|auto` overrides the choice (auto: Triton on CUDA tensors, C++ decode on CPU).
"""
from kernels.dispatch import paged_attention, prepare, varlen_attention, varlen_attention_qkv, write_kv_cache
from kernels.paged import PagedPlan, plan_step, write_and_attend

__all__ = ["PagedPlan", "paged_attention", "plan_step", "prepare", "varlen_attention", "varlen_attention_qkv",
           "write_and_attend", "write_kv_cache"]
