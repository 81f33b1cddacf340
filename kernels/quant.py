"""Weight-only quantized linear algebra on CPU: GGUF Q4_0 / Q4_1 / Q8_0 blocks and per-channel int8.

A `QuantWeight` keeps the weights as stored (GGUF blocks exactly as in the file, or int8 rows plus one float scale
per output channel) and `matmul(x, w)` computes `x @ dequantize(w).T` in float32 with them:

* small M (decode steps, up to `SMALL_M` rows): the C++ kernel `cpu/quant_matmul.cpp`, which streams each output
  row's blocks once and dequantizes them in registers (AVX2 + FMA, OpenMP over output rows). The dequantized values
  are bit-identical to GGUF's own numpy dequantizer (the one transformers uses), so the result differs from
  dequantize-then-matmul only in summation order;
* wide M: tiles of rows dequantized into float32 and multiplied by BLAS (`torch.mm`), so a wide step costs one
  pass of dequantization (cheap against M rows of FLOPs) and runs at GEMM speed.

The kernel is built like the decode-attention kernel (kernels/cpu_decode.py: torch cpp_extension + ninja,
-O3 -march=native, cached under a name keyed by this CPU). When it cannot be built, `available()` is False, the
reason is logged once, and `matmul` still works by the torch reference (slow); the engine then serves dense float32
weights instead (engine/models/quantized.py).
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("tandem.kernels")
_SOURCE = Path(__file__).parent / "cpu" / "quant_matmul.cpp"

FORMATS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "I8": 3}  # the C++ `fmt` codes
BLOCK = 32  # weights per GGUF block, along K
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}

# Up to this many rows the in-register kernel beats dequantize + GEMM (measured on a 2-core AVX2 host, see
# kernels/README.md "Quantized matmul"); wider steps dequantize tiles of TILE_BYTES of float32 and use BLAS.
SMALL_M = int(os.environ.get("TANDEM_QUANT_SMALL_M", "16"))
TILE_BYTES = 1 << 20


@dataclass(slots=True, eq=False)
class QuantWeight:
    """A [N, K] weight as stored: `data` is uint8 [N, K / 32 * block bytes] for GGUF formats, int8 [N, K] for I8
    (with float32 `scales` [N])."""
    data: torch.Tensor
    fmt: str
    shape: tuple[int, int]  # (N, K) of the dense weight
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown quantized format {self.fmt!r}; supported: {', '.join(FORMATS)}")
        if self.fmt == "I8":
            if self.data.dtype != torch.int8 or tuple(self.data.shape) != (n, k):
                raise ValueError(f"I8 weights must be int8 [{n}, {k}], got {self.data.dtype} {tuple(self.data.shape)}")
            if self.scales is None or self.scales.dtype != torch.float32 or self.scales.shape != (n,):
                raise ValueError("I8 weights need float32 scales, one per output channel")
        else:
            if k % BLOCK:
                raise ValueError(f"{self.fmt} needs K divisible by {BLOCK}, got {k}")
            expected = (n, k // BLOCK * BLOCK_BYTES[self.fmt])
            if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
                raise ValueError(f"{self.fmt} blocks must be uint8 {expected}, got {self.data.dtype} "
                                 f"{tuple(self.data.shape)}")
        self.data = self.data.contiguous()

    @property
    def nbytes(self) -> int:
        extra = self.scales.numel() * 4 if self.scales is not None else 0
        return self.data.numel() * self.data.element_size() + extra

    def _scales(self) -> torch.Tensor:
        return self.scales if self.scales is not None else _NO_SCALES

    def dequantize(self, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Rows [start, start + count) as float32."""
        count = self.shape[0] - start if count is None else count
        module = _module()
        if module is None:
            return reference_dequantize(self.data[start:start + count], self.fmt, self.shape[1],
                                        None if self.scales is None else self.scales[start:start + count])
        return module.dequantize(self.data, FORMATS[self.fmt], self.shape[1], self._scales(), start, count)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows named by int64 `ids` (any shape) as float32 [*ids.shape, K]: an embedding lookup that
        dequantizes only those rows."""
        module = _module()
        if module is None:
            flat = ids.reshape(-1)
            dense = reference_dequantize(self.data[flat], self.fmt, self.shape[1],
                                         None if self.scales is None else self.scales[flat])
            return dense.view(*ids.shape, self.shape[1])
        return module.dequantize_rows(self.data, FORMATS[self.fmt], self.shape[1], self._scales(), ids)


_NO_SCALES = torch.empty(0, dtype=torch.float32)


def extension_name() -> str:
    from kernels.cpu_decode import extension_name as keyed

    return keyed("tandem_quant_matmul", _SOURCE)


@functools.cache
def _module():
    """The compiled extension, or None when it cannot be built here (the reason is logged once)."""
    from kernels.cpu_build import load_extension

    try:
        return load_extension(extension_name(), _SOURCE, ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                              ["-fopenmp"])
    except Exception as exc:  # no compiler, no ninja, unsupported platform
        log.warning("C++ quantized matmul unavailable (%s: %s); quantized weights fall back to dense float32",
                    type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return None


def available() -> bool:
    return _module() is not None


def fused_ops(x: torch.Tensor):
    """The compiled module when `x` is a float32 CPU tensor and the extension is built (its add_rms_norm, silu_mul
    and rotary_ serve the model's decode path), else None. TANDEM_FUSED_OPS=0 turns them off (for A/B runs)."""
    if x.is_cuda or x.dtype != torch.float32 or os.environ.get("TANDEM_FUSED_OPS", "1") == "0":
        return None
    return _module()


def matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] float32 @ dequantize(w).T -> [M, N] float32."""
    module = _module()
    m = x.shape[0]
    if module is not None and m <= SMALL_M:
        return module.quant_matmul(x, w.data, FORMATS[w.fmt], w.shape[1], w._scales())
    return _dequantize_gemm(x, w)


def _dequantize_gemm(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    n, k = w.shape
    rows = max(64, TILE_BYTES // (4 * k))
    if n <= rows:
        return torch.mm(x, w.dequantize().t())
    # out^T tile by tile: a row slice of out^T is contiguous, so torch.mm writes it in place.
    out_t = torch.empty(n, x.shape[0], dtype=torch.float32)
    x_t = x.t()
    for start in range(0, n, rows):
        count = min(rows, n - start)
        torch.mm(w.dequantize(start, count), x_t, out=out_t[start:start + count])
    return out_t.t().contiguous()


# ---- pure torch: the reference and the fallback ------------------------------------------------------------


def reference_dequantize(data: torch.Tensor, fmt: str, k: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize in plain torch, with GGUF's arithmetic (fp16 scales to fp32, then d * q (+ m))."""
    if fmt == "I8":
        return data.float() * scales.float()[:, None]
    n = data.shape[0]
    blocks = data.reshape(n, k // BLOCK, BLOCK_BYTES[fmt])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [n, nb, 1]
    if fmt == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, k)
    qs = blocks[..., 4:] if fmt == "Q4_1" else blocks[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # byte i: element i (low), element i + 16 (high)
    if fmt == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        return (d * q + m).reshape(n, k)
    return (d * (q - 8)).reshape(n, k)


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Symmetric per-output-channel int8 (absmax / 127, round to nearest) of a dense [N, K] weight."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantWeight(q, "I8", tuple(w.shape), scales.contiguous())
