"""Compile every Triton kernel for NVIDIA GPUs on a machine without one (run as a fresh process).

The CPU interpreter forgives what a GPU build rejects (tl.dot tiles under 16 rows, loop-carried type
changes, shared memory overflow), so each launch plan is compiled for sm_80 and sm_90 to cubin through the
normal JIT path with a stand-in driver; inputs live on the meta device. Prints one line per build.

    python -m tests.kernels.gpu_compile
"""
from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # must happen before any @triton.jit runs

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

from kernels import triton_kv_cache, triton_paged_attention, triton_varlen_attention  # noqa: E402

# Shared memory one block may use (bytes), from the CUDA occupancy tables.
MAX_SHARED = {80: 166912, 90: 232448}


class _CompileOnlyDriver:
    """Just enough of a Triton driver for `warmup` to pick a target and compile; it can launch nothing."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")

    def is_active(self) -> bool:
        return True


def _t(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _paged(tokens: int, seqs: int, heads: int, kv_heads: int, dim: int, block: int, dtype: torch.dtype):
    q = _t(tokens, heads, dim, dtype=dtype)
    kv = _t(2, 64, block, kv_heads, dim, dtype=dtype)
    plan = triton_paged_attention.launch_plan(
        q, kv[0], kv[1], _t(seqs, 8, dtype=torch.int32), _t(seqs, dtype=torch.int32),
        _t(seqs + 1, dtype=torch.int32), dim ** -0.5, torch.empty_like(q))
    return triton_paged_attention._paged_attention_kernel, plan


def _varlen(tokens: int, seqs: int, heads: int, dim: int, dtype: torch.dtype):
    q = _t(tokens, heads, dim, dtype=dtype)
    plan = triton_varlen_attention.launch_plan(
        q, torch.empty_like(q), torch.empty_like(q), _t(seqs + 1, dtype=torch.int32), dim ** -0.5,
        torch.empty_like(q))
    return triton_varlen_attention._varlen_attention_kernel, plan


def _kv_write(tokens: int, kv_heads: int, dim: int, block: int, src: torch.dtype, cache: torch.dtype):
    kv = _t(2, 64, block, kv_heads, dim, dtype=cache)
    k = _t(tokens, kv_heads, dim, dtype=src)
    plan = triton_kv_cache.launch_plan(k, torch.empty_like(k), kv[0], kv[1], _t(tokens, dtype=torch.int64))
    return triton_kv_cache._write_kv_cache_kernel, plan


CASES = {
    "paged mixed fp16 smollm2 (9q/3kv, d64, block 16)": lambda: _paged(100, 6, 9, 3, 64, 16, torch.float16),
    "paged mixed bf16 llama-8b (32q/8kv, d128, block 32)": lambda: _paged(4096, 64, 32, 8, 128, 32, torch.bfloat16),
    "paged decode-only bf16 (32q/8kv, d128)": lambda: _paged(64, 64, 32, 8, 128, 16, torch.bfloat16),
    "paged decode-only fp16 MHA (d64)": lambda: _paged(64, 64, 8, 8, 64, 16, torch.float16),
    "paged one sequence fp32 (d24)": lambda: _paged(5, 1, 6, 2, 24, 16, torch.float32),
    "varlen fp16 minilm (12 heads, d32)": lambda: _varlen(500, 16, 12, 32, torch.float16),
    "varlen bf16 one sequence (d128)": lambda: _varlen(300, 1, 16, 128, torch.bfloat16),
    "kv write fp16 (3kv, d64)": lambda: _kv_write(100, 3, 64, 16, torch.float16, torch.float16),
    "kv write fp32 -> bf16 (8kv, d128)": lambda: _kv_write(100, 8, 128, 32, torch.float32, torch.bfloat16),
}


def main() -> int:
    failures = 0
    for capability in sorted(MAX_SHARED):
        driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", capability, 32)))
        for name, build in CASES.items():
            kernel, (grid, args, meta) = build()
            try:
                compiled = kernel.warmup(*args, grid=grid, **meta)
                shared = compiled.metadata.shared
                ok = "cubin" in compiled.asm and shared <= MAX_SHARED[capability]
                detail = f"shared={shared}B"
            except Exception as e:  # noqa: BLE001 - report every build, then fail once
                ok, detail = False, f"{type(e).__name__}: {e}".splitlines()[0]
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} sm_{capability} {name}: {detail}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
