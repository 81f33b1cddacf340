"""Paged decode attention as a C++ CPU kernel, compiled on first use with torch's cpp_extension.

On CPU the torch reference gathers every decode sequence's blocks into a padded copy before SDPA; this kernel
reads K/V in place, once. It is compiled for the CPU it runs on (-O3 -march=native) into torch's extension cache
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) under a name that carries a hash of that CPU
(`extension_name`), so a cache shared between machines (a shared home, a copied image layer) never hands one CPU
code built for another; without a C++ compiler it is simply unavailable and the reference runs instead.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import platform
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger("tandem.kernels")
_SOURCE = Path(__file__).parent / "cpu" / "paged_decode.cpp"
_CPUINFO = Path("/proc/cpuinfo")
_CPUINFO_KEYS = ("model name", "flags", "Features", "CPU implementer", "CPU part")  # x86, then Arm


def extension_name(prefix: str = "tandem_paged_decode", sources: Sequence[Path] = (_SOURCE,)) -> str:
    """`<prefix>_<hash of this CPU and the sources>` (every file the build reads, headers included, so a change to a
    header alone names a new build): -march=native code is only valid on the CPU it was built for,
    and checkouts must not rebuild each other's module in one shared directory: not when their sources differ, nor
    when the same source sits at another path (torch's build file names the source's path, so two checkouts of one
    commit rebuilt the module in turn, each waiting a minute on the other's build lock). The CPU is
    the first processor's model name and feature flags in /proc/cpuinfo (Linux), else platform.machine() and
    platform.processor()."""
    fields: dict[str, str] = {}
    try:
        for line in _CPUINFO.read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() in _CPUINFO_KEYS:
                fields.setdefault(key.strip(), " ".join(value.split()))
    except OSError:
        pass
    identity = "\n".join(f"{k}: {fields[k]}" for k in _CPUINFO_KEYS if k in fields)
    identity = identity or f"{platform.machine()} {platform.processor()}"
    digest = hashlib.sha256(identity.encode())
    for source in sources:
        digest.update(str(source.resolve()).encode() + b"\0" + source.read_bytes())
    return f"{prefix}_" + digest.hexdigest()[:12]


@functools.cache
def _module():
    """The compiled extension, or None when it cannot be built here (the reason is logged once)."""
    from kernels.cpu_build import load_extension

    try:
        # fast-math lets the dot products and exp vectorize (reassociated sums: ~1e-7 relative, scores are finite)
        return load_extension(extension_name(), [_SOURCE], ["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                              ["-fopenmp"])
    except Exception as exc:  # no compiler, no ninja, unsupported platform: the reference still works
        log.warning("C++ decode attention unavailable, using the torch reference: %s", exc)
        return None


def available() -> bool:
    return _module() is not None


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    """query [B, Hq, D], one token per sequence; seq_lens include that token. Returns [B, Hq, D]. window > 0:
    only the last `window` positions; softcap > 0: tanh soft-capped scores."""
    return _module().paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """reference.write_kv_cache for float32 caches in one C++ call: rows may be strided views of a fused qkv, and
    slot -1 writes nothing without a check on the Python side."""
    _module().write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_qkv(qkv: torch.Tensor, num_q_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One layer of a decode-only step in one call: qkv [B, Hq + 2 Hkv, D] (one token per sequence) has its K/V
    written to `slot_mapping`, then its queries attend; [B, Hq, D], the values of write_kv_cache followed by
    paged_decode_attention."""
    return _module().paged_decode_qkv(qkv, num_q_heads, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                      scale, window, softcap)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """Same contract as reference.paged_attention: decodes through the C++ kernel, prefill chunks as there."""
    return attention_from_lists(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                (query_start_loc.tolist(), seq_lens.tolist()), scale, window, softcap)


def attention_from_lists(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         starts_lens: tuple[list[int], list[int]], scale: float, window: int = 0,
                         softcap: float = 0.0, fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> torch.Tensor:
    """paged_attention with query_start_loc and seq_lens also given as lists (read once per step, not per layer);
    `fresh_kv` as reference.prefill_attention takes it."""
    from kernels import reference

    starts, lens = starts_lens
    decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    if len(decodes) == len(lens):  # a decode-only step: query rows are the sequences, in order
        return paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap)
    out = torch.empty_like(query)
    if decodes:
        idx = torch.tensor(decodes, device=query.device)
        rows = query_start_loc[idx].long()
        out[rows] = paged_decode_attention(query[rows], k_cache, v_cache, block_tables[idx], seq_lens[idx], scale,
                                           window, softcap)
    reference.prefill_attention(query, k_cache, v_cache, block_tables, starts, lens, scale, out, window, softcap,
                                fresh_kv)
    return out
