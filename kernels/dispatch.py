"""Pick the implementation per call: Triton for CUDA tensors; on CPU the C++ decode kernel where it builds
(kernels/cpu_decode.py, float32) and the torch reference for everything else.

Every op takes the backend `mode` (torch | triton | cpp | auto, default auto): what `TANDEM_KERNELS` asks for, read
once at start-up (engine/settings.py) and handed to the models, which pass it on here. Triton modules are imported on
first use, so CPU-only runs never load them.
"""
from __future__ import annotations

from typing import Protocol

import torch

from kernels import reference

MODES = ("torch", "triton", "cpp", "auto")


class _HasDevice(Protocol):
    is_cuda: bool


def backend(t: _HasDevice, mode: str = "auto") -> str:
    """"torch", "triton" or "cpp" for an op whose main input is `t`, per `mode` (TANDEM_KERNELS; "cpp" only means
    something to paged attention; the other ops run the reference under it)."""
    if mode not in MODES:
        raise ValueError(f"TANDEM_KERNELS={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "auto":
        return "triton" if t.is_cuda else "cpp"
    if mode == "triton" and not t.is_cuda and not _triton_interprets():
        raise RuntimeError("TANDEM_KERNELS=triton needs CUDA tensors (or TRITON_INTERPRET=1 to interpret on CPU)")
    return mode


def _triton_interprets() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET=1, read by Triton itself)."""
    try:
        from kernels.triton_common import interpreting
    except ImportError:  # no Triton here: nothing to interpret with
        return False
    return interpreting()


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, mode: str = "auto",
) -> None:
    if backend(k_cache, mode) == "triton":
        from kernels.triton_kv_cache import write_kv_cache as op
    else:
        op = reference.write_kv_cache
    op(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0,
    mode: str = "auto",
) -> torch.Tensor:
    """`window` > 0: sliding-window attention (the last `window` positions); `softcap` > 0: tanh soft-capped
    scores. The Triton kernel has neither yet and refuses them (NotImplementedError) rather than ignore them."""
    choice = backend(query, mode)
    if choice == "triton":
        triton_refuses(window, softcap)
        from kernels.triton_paged_attention import paged_attention as op
        return op(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    if choice == "cpp" and cpp_usable(query, mode == "cpp"):
        from kernels.cpu_decode import paged_attention as op
    else:
        op = reference.paged_attention
    return op(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window, softcap)


def triton_refuses(window: int, softcap: float) -> None:
    if window or softcap:
        raise NotImplementedError("the Triton paged attention kernel has no sliding window or soft-cap yet; "
                                  "run this model with TANDEM_KERNELS=torch")


def cpp_usable(query: torch.Tensor, forced: bool, cache: torch.Tensor | None = None) -> bool:
    """The C++ decode kernel covers float32 CPU tensors (and caches), once it has compiled; forcing it elsewhere
    (`forced`: TANDEM_KERNELS=cpp, where auto falls back to the reference) is an error."""
    from kernels import cpu_decode

    usable = (not query.is_cuda and query.dtype == torch.float32 and cpu_decode.available()
              and (cache is None or (not cache.is_cuda and cache.dtype == torch.float32)))
    if forced and not usable:
        raise RuntimeError("TANDEM_KERNELS=cpp needs float32 CPU tensors and a C++ compiler (see the log)")
    return usable


def varlen_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
    mode: str = "auto",
) -> torch.Tensor:
    if backend(query, mode) == "triton":
        from kernels.triton_varlen_attention import varlen_attention as op
    else:
        op = reference.varlen_attention
    return op(query, key, value, cu_seqlens, scale)



def varlen_attention_qkv(qkv: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, mode: str = "auto"
                         ) -> torch.Tensor:
    """`varlen_attention` of q, k and v packed side by side ([T, 3, H, D], one fused projection's output)."""
    if backend(qkv, mode) == "triton":
        from kernels.triton_varlen_attention import varlen_attention as op
        return op(*qkv.unbind(1), cu_seqlens, scale)
    return reference.varlen_attention_qkv(qkv, cu_seqlens, scale)

def prepare(device: str, dtype: torch.dtype, mode: str = "auto") -> None:
    """Build what the chosen backend compiles on first use (the C++ decode kernel takes up to a minute the first
    time on a machine), so that cost lands at start-up rather than on the first request."""
    probe = torch.empty(0, device=device, dtype=dtype)
    if backend(probe, mode) == "cpp" and dtype == torch.float32:
        from kernels import cpu_decode

        cpu_decode.available()
