"""Attention kernel benchmark (GPU only): Triton vs torch baselines, in the same run.

Decode: achieved memory bandwidth (K/V, queries and outputs moved once) as a fraction of the device copy
bandwidth measured here (`torch` copy of a large tensor). Prefill: attention TFLOP/s. Baselines:
`torch_gather_sdpa` is the torch reference (gather KV through the block table, then SDPA, what the engine
runs without Triton); `torch_dense_sdpa` is SDPA over KV already contiguous (no paging cost, a lower bound
on what a paged kernel can hope for). Writes bench/results/kernel_speed.json.

    python -m bench.kernel_speed [--decode-seqs 64,256] [--context 1024] [--dtypes float16,bfloat16]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kernels import reference

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--decode-seqs", default="64,256", help="comma-separated batch sizes of decode sequences")
    p.add_argument("--context", type=int, default=1024, help="context length of every decode sequence")
    p.add_argument("--prefill-seqs", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=2048, help="fresh prompt tokens per prefill sequence")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, choices=(16, 32))
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the tensor copied to measure bandwidth")
    p.add_argument("--out", type=Path, default=RESULTS / "kernel_speed.json")
    args = p.parse_args(argv)
    args.decode_seqs = [int(x) for x in args.decode_seqs.split(",")]
    names = args.dtypes.split(",")
    if any(n not in ("float16", "bfloat16", "float32") for n in names):
        p.error(f"--dtypes: expected float16, bfloat16 or float32, got {args.dtypes}")
    args.dtypes = [getattr(torch, n) for n in names]
    if args.num_heads % args.num_kv_heads:
        p.error("--num-heads must be a multiple of --num-kv-heads")
    return args


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds per call; do_bench clears L2 between calls, so KV really comes from HBM."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth_gbps(mib: int) -> float:
    src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e9  # read + write


def paged_inputs(shape: Shape, cached: list[int], q_lens: list[int], dtype: torch.dtype, device: str) -> dict:
    """A paged batch on the GPU with shuffled blocks, plus the same K/V gathered dense for SDPA."""
    ctx = [c + q for c, q in zip(cached, q_lens)]
    bs = shape.block_size
    n_blocks = [-(-n // bs) for n in ctx]
    total = sum(n_blocks)
    kv = torch.randn(2, total, bs, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype)
    perm = torch.randperm(total, device=device).to(torch.int32)
    tables = torch.zeros(len(ctx), max(n_blocks), dtype=torch.int32, device=device)
    used = 0
    for b, nb in enumerate(n_blocks):
        tables[b, :nb] = perm[used:used + nb]
        used += nb
    q_len_t = torch.tensor(q_lens, device=device)
    return dict(
        query=torch.randn(sum(q_lens), shape.num_heads, shape.head_dim, device=device, dtype=dtype),
        k_cache=kv[0], v_cache=kv[1], block_tables=tables,
        seq_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        query_start_loc=torch.cat([q_len_t.new_zeros(1), q_len_t.cumsum(0)]).to(torch.int32),
        scale=shape.head_dim ** -0.5,
    )


def run_paged(impl: Callable, inp: dict) -> torch.Tensor:
    return impl(inp["query"], inp["k_cache"], inp["v_cache"], inp["block_tables"], inp["seq_lens"],
                inp["query_start_loc"], inp["scale"])


def dense_kv(inp: dict, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Hkv, length, D] K and V gathered once, outside the timed region (equal-length batches only)."""
    k = inp["k_cache"][inp["block_tables"].long()].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()
    v = inp["v_cache"][inp["block_tables"].long()].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()
    return k, v


def bench_decode(
    shape: Shape, num_seqs: int, context: int, dtype: torch.dtype, copy_gbps: float, device: str = "cuda"
) -> dict:
    from kernels.triton_paged_attention import paged_attention as triton_paged

    inp = paged_inputs(shape, [context - 1] * num_seqs, [1] * num_seqs, dtype, device)
    k, v = dense_kv(inp, context)
    q = inp["query"].unsqueeze(2)  # [B, Hq, 1, D]
    elem = torch.finfo(dtype).bits // 8
    moved = (2 * num_seqs * context * shape.num_kv_heads + 2 * num_seqs * shape.num_heads) * shape.head_dim * elem
    gqa = shape.num_heads != shape.num_kv_heads
    timings = {
        "triton": time_ms(lambda: run_paged(triton_paged, inp)),
        "torch_gather_sdpa": time_ms(lambda: run_paged(reference.paged_attention, inp)),
        "torch_dense_sdpa": time_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=inp["scale"], enable_gqa=gqa)),
    }
    err = (run_paged(triton_paged, inp).float() - run_paged(reference.paged_attention, inp).float()).abs().max()
    row: dict = {"dtype": str(dtype).removeprefix("torch."), "num_seqs": num_seqs, "context": context,
                 "bytes_moved": moved, "max_abs_err_vs_torch": float(err)}
    for name, ms in timings.items():
        gbps = moved / (ms * 1e-3) / 1e9
        row[name] = {"ms": ms, "GBps": gbps, "fraction_of_copy_bw": gbps / copy_gbps}
    row["triton_speedup_vs_torch_gather_sdpa"] = timings["torch_gather_sdpa"] / timings["triton"]
    row["triton_speedup_vs_torch_dense_sdpa"] = timings["torch_dense_sdpa"] / timings["triton"]
    return row


def bench_prefill(shape: Shape, num_seqs: int, length: int, dtype: torch.dtype, device: str = "cuda") -> dict:
    from kernels.triton_paged_attention import paged_attention as triton_paged

    inp = paged_inputs(shape, [0] * num_seqs, [length] * num_seqs, dtype, device)
    k, v = dense_kv(inp, length)
    q = inp["query"].view(num_seqs, length, shape.num_heads, shape.head_dim).transpose(1, 2).contiguous()
    # Causal: query i attends to i + 1 keys; QK^T and PV are 2 FLOPs per multiply-add each.
    flops = 4 * num_seqs * shape.num_heads * shape.head_dim * length * (length + 1) / 2
    gqa = shape.num_heads != shape.num_kv_heads
    timings = {
        "triton": time_ms(lambda: run_paged(triton_paged, inp)),
        "torch_gather_sdpa": time_ms(lambda: run_paged(reference.paged_attention, inp)),
        "torch_dense_sdpa": time_ms(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=inp["scale"], enable_gqa=gqa)),
    }
    err = (run_paged(triton_paged, inp).float() - run_paged(reference.paged_attention, inp).float()).abs().max()
    row: dict = {"dtype": str(dtype).removeprefix("torch."), "num_seqs": num_seqs, "length": length,
                 "flops": flops, "max_abs_err_vs_torch": float(err)}
    for name, ms in timings.items():
        row[name] = {"ms": ms, "TFLOPs": flops / (ms * 1e-3) / 1e12}
    row["triton_speedup_vs_torch_gather_sdpa"] = timings["torch_gather_sdpa"] / timings["triton"]
    row["triton_speedup_vs_torch_dense_sdpa"] = timings["torch_dense_sdpa"] / timings["triton"]
    return row


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/kernel_speed.py measures Triton kernels on a CUDA GPU; none is visible here, nothing was run.")
    shape = Shape(args.num_heads, args.num_kv_heads, args.head_dim, args.block_size)
    copy_gbps = copy_bandwidth_gbps(args.copy_mib)
    result = {
        "device": torch.cuda.get_device_name(),
        "shape": vars(shape),
        "copy_bandwidth_GBps": copy_gbps,
        "decode": [bench_decode(shape, n, args.context, dt, copy_gbps) for dt in args.dtypes for n in args.decode_seqs],
        "prefill": [bench_prefill(shape, args.prefill_seqs, args.prefill_len, dt) for dt in args.dtypes],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
