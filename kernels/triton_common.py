"""Helpers shared by the Triton kernels: ragged-batch work lookup and host-side launch choices."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def find_seq(starts_ptr, block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence owning global q-block `block_idx`, with q-blocks numbered `starts[b] // BLOCK_Q + b`.

    That numbering is strictly increasing and leaves room for every sequence's ceil(len / BLOCK_Q) blocks,
    so a grid of `T // BLOCK_Q + B` programs covers a ragged batch without reading lengths on the host.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(starts_ptr + mid) // BLOCK_Q + mid
        if first <= block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


def num_q_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Grid size for `find_seq` numbering: an upper bound on sum(ceil(len_b / block_q))."""
    return num_tokens // block_q + num_seqs


def compute_mode(t: torch.Tensor) -> tuple[bool, str]:
    """(upcast, dot precision) for inputs like `t`.

    fp32 inputs, and every input in the interpreter (whose bf16 arithmetic is wrong), are computed in fp32
    with exact dots: TF32 would miss the reference by ~1e-3. On a GPU fp16/bf16 tiles stay native so tl.dot
    runs on tensor cores with fp32 accumulation; the precision setting is then ignored.
    """
    upcast = t.dtype == torch.float32 or interpreting()
    return upcast, "ieee" if upcast else "tf32"


def interpreting() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET=1, as Triton itself reads it)."""
    return bool(triton.knobs.runtime.interpret)
