"""Weight-only quantized linear algebra on CPU: GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16,
BF16) and per-channel int8.

A `QuantWeight` keeps the weights as stored (GGUF blocks exactly as in the file, or int8 rows plus one float scale
per output channel) and `matmul(x, w)` computes `x @ dequantize(w).T` in float32 with them:

* small M (decode steps, up to `small_m(isa)` rows): the C++ kernels of `cpu/quant/`, which stream each output
  row's blocks once and dequantize them in registers (OpenMP over output rows), every format on the AVX-512 and
  AVX2 paths (the portable path dequantizes a row at a time into a buffer). The dequantized values are
  bit-identical to GGUF's own numpy dequantizer (the one transformers uses) on every path, so the result differs
  from dequantize-then-matmul only in summation order;
* wide M: tiles of rows dequantized into float32 and multiplied by BLAS (`torch.mm`), so a wide step costs one
  pass of dequantization (cheap against M rows of FLOPs) and runs at GEMM speed (the K-quants with int8 activations
  stay on their int8 kernel to `int8_rows`: wider than small M, and every width on a host without AVX-512); where
  the activations are rounded anyway (int8 for the format) and the CPU multiplies bf16 natively, the tiles are
  dequantized into bf16 for oneDNN's bf16 GEMM instead (`CpuPath.bf16_gemm`, `_bf16_gemm`).

The CPU path (`CpuPath`: its `CpuIsa`, AVX-512, AVX2 or portable, and the widths and wide-step precision that go
with it) is a value, not process state: an engine's builder resolves one from engine/settings.py's values
(`resolve_cpu_path`: the widest this CPU has, or `TANDEM_CPU_ISA=avx2|portable` to force a narrower one) and its model
holds it and hands it to every call (`matmul(..., path=)`), so two engines in one process each compute with their own.
Callers with no model (kernel tests, benchmarks) get this CPU's auto path (`default_cpu_path`); tests and A/B runs
also pass `isa=` per call.

The kernel is built like the decode-attention kernel (kernels/cpu_decode.py: torch cpp_extension + ninja,
-O3 -march=native, cached under a name keyed by this CPU). When it cannot be built, `available()` is False, the
reason is logged once, and `matmul` still works by the torch reference (slow); the engine then serves dense float32
weights instead (engine/models/quantized.py).
"""
from __future__ import annotations

import enum
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import linear as _linear

log = logging.getLogger("tandem.kernels")
# cpu/quant/: block formats, one file per CPU path, the matmul entry points, fused ops, the layer walker, the binding
_SOURCE_DIR = Path(__file__).parent / "cpu" / "quant"
_SOURCES = sorted(_SOURCE_DIR.glob("*.cpp"))
_HEADERS = sorted(_SOURCE_DIR.glob("*.h"))

# the C++ `fmt` codes (cpu/quant/formats.h)
CPP_FORMATS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "I8": 3, "Q5_0": 4, "Q5_1": 5, "Q4_K": 6, "Q5_K": 7, "Q6_K": 8}
BLOCK = 32  # weights per block of the 32-wide GGUF formats, along K
QK_K = 256  # weights per super-block of the K-quants
# GGUF block formats kept as stored: weights per block along K, bytes per block. F16 / BF16 have no C++ code: torch
# converts tiles of them (`reference_dequantize`) for BLAS.
BLOCK_ELEMS = {"Q4_0": BLOCK, "Q4_1": BLOCK, "Q5_0": BLOCK, "Q5_1": BLOCK, "Q8_0": BLOCK,
               "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K, "F16": 1, "BF16": 1}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34,
               "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "F16": 2, "BF16": 2}
FORMATS = (*BLOCK_BYTES, "I8")

# Up to this many rows the in-register kernel beats dequantize + GEMM, per CPU path (measured on the 2-core hosts,
# see kernels/README.md "Quantized matmul"; TANDEM_QUANT_SMALL_M overrides); wider steps dequantize tiles of
# TILE_BYTES of float32 and use BLAS. AVX-512 takes up to 16 rows in one pass over the weights (paths.h
# for_row_tiles_exact16), so it stays ahead of the GEMM to 16 rows as AVX2 does.
_SMALL_M = {"avx512": 16, "avx2": 16, "portable": 16}
# The K-quants' int8 kernels (per int8 kernel: `int8_kernel`) stay ahead of dequantize + GEMM to more rows than the
# float32 ones: they read each weight once per tile of rows and multiply bytes, where the GEMM pays a float32
# dequantize of the whole matrix first. Measured 2026-11-28 (2-core Xeon, AVX-512 VNNI, 2 threads; SmolLM2-1.7B's
# Q4_K / Q6_K projections and Gemma 3 270M's Q6_K): vnni 0.5-0.6x the GEMM's time at 32 rows, 0.6-0.9x at 64, level
# at 128; the avx2 int8 kernel 0.65-0.8x at 32, level at 64. kernels/README.md "Quantized matmul". Those widths are
# against MKL's AVX-512 GEMM. On a host whose widest path is AVX2 the GEMM is AVX2 too, and there the avx2 int8 kernel
# stayed ahead at every width up to a CPU step's default 512 rows (2026-11-28, 2-core AMD EPYC, AVX2 + FMA, no
# AVX-512, idle, the same 1.7B projections: 0.55-0.6x the GEMM's time at 32 rows, 0.6-0.7x at 64, 0.75-0.8x at 128,
# 0.7-1.0x at 256, 0.77-0.86x at 512), so on such a host it takes every step (`int8_rows` None).
_INT8_KQUANT_M = {"vnni": 64, "avx2": 32}
# Where the wider steps multiply bf16 on AMX tiles (`CpuPath.bf16_gemm` on a CPU with AMX) the bf16 GEMM overtakes the
# int8 kernel sooner: measured 2026-12-02 (2-core Xeon with AMX, 2 threads, idle, median of 7; the 1.7B projections
# and Gemma 3 270M's 640x2048 Q6_K): bf16 0.85-1.2x the vnni kernel's time at 32 rows, 0.67-0.94x at 48, 0.52-0.77x
# at 64, 0.38-0.46x at 128, 0.11-0.18x at 512 (kernels/README.md "Quantized matmul").
_INT8_KQUANT_M_AMX = {"vnni": 32, "avx2": 32}
# The float32 wide path's tiles of dequantized weights (`_dequantize_gemm`), written straight into the output's
# columns: 4 MiB measured level with or ahead of 1 and 8 MiB at 17-512 rows (2026-12-07, 2-core AMD EPYC, AVX2, one
# thread, SmolLM2-135M's and SmolLM2-1.7B's shapes; 1 MiB tiles 1.05-1.2x the time at 512 rows).
TILE_BYTES = 4 << 20
# The bf16 wide path's tiles of dequantized weights (`_bf16_gemm`): 8 MiB measured best of 1-16 MiB (2026-12-02, AMX,
# the same shapes: 1 MiB tiles took 1.2-1.7x the time at 512 rows, 16 MiB level with 8).
BF16_TILE_BYTES = 8 << 20


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
            per = BLOCK_ELEMS[self.fmt]
            if k % per:
                raise ValueError(f"{self.fmt} needs K divisible by {per}, got {k}")
            expected = (n, k // per * BLOCK_BYTES[self.fmt])
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

    def dequantize(self, start: int = 0, count: int | None = None, isa: CpuIsa | None = None) -> torch.Tensor:
        """Rows [start, start + count) as float32, by the C++ code of vector path `isa` (None: `default_cpu_path()`'s;
        the values are the same on every path)."""
        count = self.shape[0] - start if count is None else count
        module = _module() if self.fmt in CPP_FORMATS else None
        if module is None:
            return reference_dequantize(self.data[start:start + count], self.fmt, self.shape[1],
                                        None if self.scales is None else self.scales[start:start + count])
        return module.dequantize(self.data, CPP_FORMATS[self.fmt], self.shape[1], self._scales(), start, count,
                                 default_cpu_path().isa if isa is None else isa)

    def rows(self, ids: torch.Tensor, isa: CpuIsa | None = None) -> torch.Tensor:
        """The rows named by int64 `ids` (any shape) as float32 [*ids.shape, K]: an embedding lookup that
        dequantizes only those rows (on vector path `isa`, as `dequantize`)."""
        module = _module() if self.fmt in CPP_FORMATS else None
        if module is None:
            flat = ids.reshape(-1)
            dense = reference_dequantize(self.data[flat], self.fmt, self.shape[1],
                                         None if self.scales is None else self.scales[flat])
            return dense.view(*ids.shape, self.shape[1])
        return module.dequantize_rows(self.data, CPP_FORMATS[self.fmt], self.shape[1], self._scales(), ids,
                                      default_cpu_path().isa if isa is None else isa)


_NO_SCALES = torch.empty(0, dtype=torch.float32)


class CpuIsa(enum.IntEnum):
    """The vector instructions the C++ kernels compute with (the `isa` codes of cpu/quant/formats.h)."""
    PORTABLE = 0
    AVX2 = 1
    AVX512 = 2

    @property
    def label(self) -> str:
        return self.name.lower()


def best_isa() -> CpuIsa:
    """The widest path the built module has (it is compiled for this CPU); PORTABLE when nothing is built."""
    module = _module()
    return CpuIsa(module.best_isa()) if module is not None else CpuIsa.PORTABLE


@dataclass(frozen=True, slots=True)
class CpuPath:
    """A CPU path the quantized kernels compute with: its vector instructions; when set, the most rows the
    in-register kernel takes (None: the measured value of that path, `_SMALL_M`); and whether wide steps with
    reduced-precision activations multiply bfloat16 (`bf16_gemm`). An engine's is resolved once by its builder
    (`resolve_cpu_path`) and held by its model; callers with no model take `default_cpu_path()`."""
    isa: CpuIsa
    small_m: int | None = None
    bf16_gemm: bool = False


_ISAS = {isa.label: isa for isa in CpuIsa}


def resolve_cpu_path(wanted: str = "auto", small_m: int | None = None, native_bf16: bool = False) -> CpuPath:
    """The path these settings ask for (the engine's builder, from TANDEM_CPU_ISA, TANDEM_QUANT_SMALL_M and
    TANDEM_NATIVE_BF16 in engine/settings.py): `wanted` is auto (the widest this CPU has) or a CpuIsa label; asking
    for a path this CPU lacks is an error, not a silent downgrade. `native_bf16=True` (the builder's default,
    Settings.native_bf16) lets wide steps with reduced-precision activations multiply bf16 where
    `bf16_gemm_available`; False keeps them float32 on every CPU. A function of its arguments and this CPU only (it
    builds the C++ module to ask what the CPU has, so the builder calls it only for a model with quantized
    weights)."""
    if wanted != "auto" and wanted not in _ISAS:
        raise ValueError(f"TANDEM_CPU_ISA={wanted!r}: expected auto or one of {', '.join(_ISAS)}")
    best = best_isa()
    if wanted != "auto" and _ISAS[wanted] > best:
        raise ValueError(f"TANDEM_CPU_ISA={wanted}: this CPU's kernels go up to {best.label}")
    isa = best if wanted == "auto" else _ISAS[wanted]
    return CpuPath(isa, small_m, native_bf16 and bf16_gemm_available(isa))


@functools.cache
def default_cpu_path() -> CpuPath:
    """The path of a call that names none (kernel tests, benchmarks, weights outside a model): this CPU's auto path,
    with the measured widths and float32 wide steps (`resolve_cpu_path()`), resolved on first use."""
    return resolve_cpu_path()


def bf16_gemm_available(isa: CpuIsa) -> bool:
    """Whether wide steps can multiply bfloat16 on path `isa`: the AVX-512 path (a forced narrower one stands for a
    CPU without AVX-512, and no CPU without it has bf16 dot products) on a CPU whose oneDNN multiplies bf16 natively
    (kernels.linear.native_bf16: AVX512_BF16 or AMX)."""
    return isa is CpuIsa.AVX512 and _linear.native_bf16()


def _bf16_wide(path: CpuPath, isa: CpuIsa) -> bool:
    """Whether a call on path `isa` (`path`'s, or one a test forces) takes `path`'s bf16 wide steps: only on the
    AVX-512 path they were chosen for."""
    return path.bf16_gemm and isa is CpuIsa.AVX512


class Activations(enum.Enum):
    """What the small-M kernels multiply the weights with: float32 activations (results differ from
    dequantize-then-matmul by summation order only), or each activation row quantized to int8 per block of 32 as
    llama.cpp does, with integer dot products (every GGUF block format: per block of 32 for the 32-wide ones, per
    super-block of 256 for the K-quants; I8 stays float32): AVX-512 VNNI on the avx512 path, AVX2's maddubs on the
    avx2 path (and on avx512 without VNNI); the K-quants through avx512_k8.cpp on the avx512 path and avx2_int8.cpp's
    row_k8 on the avx2 path. AUTO (the engine's default) is int8 for the formats where it measured faster at batch
    1 on both paths (`INT8_AUTO_FORMATS`: the K-quants, 2.2-3x per matmul at 1.7B) and float32 for the others;
    wider steps than `int8_rows` are float32 GEMMs whatever the setting (on a host without AVX-512, none are for the
    K-quants). Bounds and measurements: kernels/README.md."""
    FLOAT32 = "float32"
    INT8 = "int8"
    AUTO = "auto"


INT8_BLOCK32 = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # x rounded per block of 32 (llama.cpp's Q8_0)
INT8_KQUANTS = ("Q4_K", "Q5_K", "Q6_K")  # x rounded per super-block of 256 (llama.cpp's Q8_K)
INT8_FORMATS = INT8_BLOCK32 + INT8_KQUANTS  # every GGUF block format; I8, F16 and BF16 stay float32
INT8_AUTO_FORMATS = INT8_KQUANTS  # Activations.AUTO: int8 for these, float32 for the rest (on avx512 and avx2 alike)


def takes_int8(activations: Activations, fmt: str) -> bool:
    """Whether a small-M matmul of `fmt` weights multiplies int8 activations under `activations` (where the CPU path
    has an int8 kernel: not the portable path)."""
    if activations is Activations.INT8:
        return fmt in INT8_FORMATS
    return activations is Activations.AUTO and fmt in INT8_AUTO_FORMATS


def int8_kernel(isa: CpuIsa | None = None) -> str:
    """The kernel that multiplies int8 activations on CPU path `isa` (default: `default_cpu_path()`'s): "vnni",
    "avx2", or "" where there is none (the portable path, no C++ build)."""
    module = _module()
    return module.int8_kernel(int(default_cpu_path().isa if isa is None else isa)) if module is not None else ""


def int8_activations_available(path: CpuPath | None = None) -> bool:
    """Whether CPU path `path` (default: `default_cpu_path()`) has int8-activation kernels (avx512 or avx2, not
    portable)."""
    return bool(int8_kernel(None if path is None else path.isa))


def small_m(isa: CpuIsa, path: CpuPath | None = None) -> int:
    """The most rows `matmul` gives the register kernel on vector path `isa`; more go to dequantize + GEMM. `path`
    sets it where its `small_m` does (TANDEM_QUANT_SMALL_M; None: the measured value)."""
    override = None if path is None else path.small_m
    return _SMALL_M[isa.label] if override is None else override


def int8_rows(isa: CpuIsa, fmt: str, bf16: bool = False, path: CpuPath | None = None) -> int | None:
    """The most rows `matmul` gives the int8 kernel for `fmt` on vector path `isa` (int8 activations; None: every
    step): the K-quants' int8 kernels go wider than `small_m` (`_INT8_KQUANT_M`; `_INT8_KQUANT_M_AMX` where the wider
    steps multiply bf16 on AMX tiles, `bf16`), and on a host without AVX-512 (whose GEMM is AVX2 too) the avx2 one
    takes every width; the rest stop at small_m. `path`'s `small_m` (TANDEM_QUANT_SMALL_M) sets all of them."""
    override = None if path is None else path.small_m
    if override is not None:
        return override
    if fmt not in INT8_KQUANTS:
        return _SMALL_M[isa.label]
    kernel = int8_kernel(isa)
    if kernel == "avx2" and best_isa() < CpuIsa.AVX512:
        return None
    widest = _INT8_KQUANT_M_AMX if bf16 and amx() else _INT8_KQUANT_M
    return max(_SMALL_M[isa.label], widest.get(kernel, 0))


@functools.cache
def amx() -> bool:
    """Whether this CPU has AMX tiles (oneDNN's bf16 GEMM runs ~6x its float32 rate on them)."""
    return bool(torch.cpu._is_amx_tile_supported())


def register_rows(fmt: str, activations: Activations, path: CpuPath | None = None) -> int | None:
    """The most rows `matmul(..., path=path)` keeps on an in-register kernel for `fmt` under `activations` (`path`
    default: `default_cpu_path()`): the int8 kernel's width where it takes the format (`int8_rows`, None: every
    width), else `small_m`. The layer walker takes decode steps up to the least of its projections' widths, so a step
    gives the same bits walked or looped."""
    path = default_cpu_path() if path is None else path
    isa = path.isa
    if takes_int8(activations, fmt) and int8_kernel(isa):
        return int8_rows(isa, fmt, _bf16_wide(path, isa), path)
    return small_m(isa, path)


def kernel_path(path: CpuPath | None = None) -> str:
    """What ModelInfo and the step spans name as the CPU path of the quantized kernels on `path` (default:
    `default_cpu_path()`; "" when none is built)."""
    return (default_cpu_path() if path is None else path).isa.label if available() else ""


def extension_name() -> str:
    from kernels.cpu_decode import extension_name as keyed

    return keyed("tandem_quant_matmul", [*_SOURCES, *_HEADERS])


@functools.cache
def _module():
    """The compiled extension, or None when it cannot be built here (the reason is logged once)."""
    from kernels.cpu_build import load_extension

    try:
        return load_extension(extension_name(), _SOURCES, ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                              ["-fopenmp"])
    except Exception as exc:  # no compiler, no ninja, unsupported platform
        log.warning("C++ quantized matmul unavailable (%s: %s); quantized weights fall back to dense float32",
                    type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return None


def available() -> bool:
    return _module() is not None


def decode_layers(num_heads: int, num_kv_heads: int, head_dim: int, eps: float, gelu: bool):
    """An empty C++ layer walker (cpu/quant/layer_walker.h `DecodeLayers`: every layer of a small decode-only step in one
    call, GIL released), or None when either C++ module is not built. Its attention is cpu/paged_decode.cpp's
    `paged_decode_qkv`, handed over by address."""
    from kernels import cpu_decode

    module, attention = _module(), cpu_decode._module()
    if module is None or attention is None:
        return None
    return module.DecodeLayers(num_heads, num_kv_heads, head_dim, eps, gelu, attention.paged_decode_qkv_capsule())


def projection(parts: list[QuantWeight], bias: torch.Tensor | None = None,
               activations: Activations = Activations.FLOAT32):
    """A walker's projection: the parts' output rows in order (each kept as stored), plus an optional float32 bias.
    `activations=INT8` (AUTO): x's rows quantized once per call and multiplied by the int8 kernel in the parts whose
    format has one (`takes_int8`) where the walked path has one, as `matmul` does part by part; the others take
    float32."""
    module = _module()
    return module.Projection([w.data for w in parts], [CPP_FORMATS[w.fmt] for w in parts],
                             [w._scales() for w in parts], parts[0].shape[1], bias,
                             [takes_int8(activations, w.fmt) for w in parts])


def matmul(x: torch.Tensor, w: QuantWeight, isa: CpuIsa | None = None,
           activations: Activations = Activations.FLOAT32, bf16: bool | None = None,
           path: CpuPath | None = None) -> torch.Tensor:
    """x [M, K] float32 @ dequantize(w).T -> [M, N] float32 on CPU path `path` (the model's; None:
    `default_cpu_path()`); `isa` overrides its vector instructions (tests). `activations=INT8` (AUTO: for the formats
    `takes_int8` names) quantizes x's rows (per block of 32, or 256 for a K-quant) in the small-M kernel where the
    path and format have it; steps wider than that kernel takes multiply in bfloat16 where `bf16` (None: the path's
    `CpuPath.bf16_gemm`, on the AVX-512 path) and float32 otherwise. float32 activations are float32 at every
    width."""
    module = _module() if w.fmt in CPP_FORMATS else None
    if module is None:
        return _dequantize_gemm(x, w)
    if path is None:  # the default path, or a test's `isa` with the default's widths (no default resolved for it)
        path = default_cpu_path() if isa is None else CpuPath(isa)
    isa = path.isa if isa is None else isa
    if bf16 is None:
        bf16 = _bf16_wide(path, isa)
    rows = x.shape[0]
    reduced = takes_int8(activations, w.fmt)
    if reduced and module.int8_kernel(int(isa)):
        wide = int8_rows(isa, w.fmt, bf16, path)
        if wide is None or rows <= wide:
            return module.quant_matmul_int8(x, w.data, CPP_FORMATS[w.fmt], w.shape[1], int(isa))
    if rows <= small_m(isa, path):
        return module.quant_matmul(x, w.data, CPP_FORMATS[w.fmt], w.shape[1], w._scales(), isa)
    if reduced and bf16:
        return _bf16_gemm(module, x, w, isa)
    if reduced and gemm_int8(isa, w.fmt):
        return module.quant_gemm_int8(x, w.data, CPP_FORMATS[w.fmt], w.shape[1], int(isa))
    return _dequantize_gemm(x, w, path.isa)


GEMM_INT8_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1")  # the wide int8 GEMM's (avx2_int8.cpp gemm_int8_avx2)


def gemm_int8(isa: CpuIsa, fmt: str) -> bool:
    """Whether a wide step of `fmt` weights with int8 activations multiplies with the repacked int8 GEMM
    (avx2_int8.cpp `gemm_int8_avx2`) on vector path `isa`: the avx2 path only (it measured 1.3-1.6x MKL's AVX2
    float32 GEMM at 512 rows, kernels/README.md "Prefill on CPU"; on the avx512 path MKL's float32 GEMM runs 16 lanes
    and the bf16 GEMM takes over where the CPU has it, so it was not chosen there), for Q4_0 / Q4_1 / Q5_0 / Q5_1."""
    module = _module()
    return (isa is CpuIsa.AVX2 and fmt in GEMM_INT8_FORMATS and module is not None
            and module.has_gemm_int8(int(isa), CPP_FORMATS[fmt]))


def prefill_path(path: CpuPath | None, activations: Activations, formats: list[str]) -> str:
    """What a wide step (a prefill chunk past the register kernels) multiplies the quantized weights of `formats`
    with on `path`, for the start-up line: per format "int8 GEMM", "int8 kernel" (the K-quants' int8 kernel at every
    width), "bf16 GEMM" or "float32 dequantize + BLAS GEMM"; "" when no format is quantized by the C++ kernels."""
    path = default_cpu_path() if path is None else path
    if not available():
        return ""
    isa, ways = path.isa, {}
    for fmt in formats:
        reduced = takes_int8(activations, fmt) and bool(int8_kernel(isa))
        if fmt not in CPP_FORMATS:
            way = "float32 dequantize + BLAS GEMM"
        elif reduced and int8_rows(isa, fmt, _bf16_wide(path, isa), path) is None:
            way = "int8 kernel"
        elif reduced and _bf16_wide(path, isa):
            way = "bf16 GEMM"
        elif reduced and gemm_int8(isa, fmt):
            way = "int8 GEMM"
        else:
            way = "float32 dequantize + BLAS GEMM"
        ways.setdefault(way, []).append(fmt)
    return ", ".join(f"{'+'.join(f)} {way}" for way, f in ways.items()) + f" ({isa.label})" if ways else ""


def _bf16_gemm(module, x: torch.Tensor, w: QuantWeight, isa: CpuIsa) -> torch.Tensor:
    """A wide step in bfloat16: x rounded to bf16 once, tiles of weight rows dequantized straight into bf16 (C++
    `dequantize_bf16`, the float32 values rounded to nearest even) and multiplied by oneDNN's bf16 GEMM (AMX tiles
    or AVX512_BF16 dot products, float32 accumulation), each tile's bf16 output widened into its float32 columns."""
    n, k = w.shape
    rows = max(64, BF16_TILE_BYTES // (2 * k))
    xb = x.to(torch.bfloat16)
    code, scales = CPP_FORMATS[w.fmt], w._scales()
    if n <= rows:
        return torch.mm(xb, module.dequantize_bf16(w.data, code, k, scales, 0, n, int(isa)).t()).float()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    for start in range(0, n, rows):
        count = min(rows, n - start)
        out[:, start:start + count] = torch.mm(xb, module.dequantize_bf16(w.data, code, k, scales, start, count,
                                                                          int(isa)).t())
    return out


def _dequantize_gemm(x: torch.Tensor, w: QuantWeight, isa: CpuIsa | None = None) -> torch.Tensor:
    """A wide step in float32: tiles of about TILE_BYTES of W's rows dequantized and multiplied by BLAS straight into
    their columns of the output (`x @ tile.T` into a column slice, whose row stride BLAS takes as its leading
    dimension: no copy of the output, which the transposed tiles before cost 5-10% of a 512-row step)."""
    n, k = w.shape
    rows = max(64, TILE_BYTES // (4 * k))
    if n <= rows:
        return torch.mm(x, w.dequantize(isa=isa).t())
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    for start in range(0, n, rows):
        count = min(rows, n - start)
        torch.mm(x, w.dequantize(start, count, isa).t(), out=out[:, start:start + count])
    return out


# ---- pure torch: the reference and the fallback ------------------------------------------------------------


def reference_dequantize(data: torch.Tensor, fmt: str, k: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize rows in plain torch with gguf-py's arithmetic, op for op (fp16 scales to fp32, then the same
    products and sums in the same order), so the values are bit-identical to `gguf.quants.dequantize`."""
    if fmt == "I8":
        return data.float() * scales.float()[:, None]
    n = data.shape[0]
    if fmt in ("F16", "BF16"):
        return data.contiguous().view(torch.float16 if fmt == "F16" else torch.bfloat16).float().reshape(n, k)
    blocks = data.reshape(n, k // BLOCK_ELEMS[fmt], BLOCK_BYTES[fmt])
    return _DEQUANT[fmt](blocks).reshape(n, k)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Byte i of a 32-wide group holds element i (low nibble) and element i + 16 (high nibble)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """The 32 fifth bits of a Q5_0 / Q5_1 block (a little-endian uint32), as 0/1 uint8 [.., 32]."""
    word = qh.contiguous().view(torch.int32)  # [.., 1]
    return ((word >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)


def _q4_0(b):
    q = _nibbles(b[..., 2:]).float()
    return _f16(b[..., 0:2]) * (q - 8)


def _q4_1(b):
    q = _nibbles(b[..., 4:]).float()
    return _f16(b[..., 0:2]) * q + _f16(b[..., 2:4])


def _q5_0(b):
    q = (_nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6]) << 4)).to(torch.int8) - 16
    return _f16(b[..., 0:2]) * q.float()


def _q5_1(b):
    q = (_nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8]) << 4)).float()
    return _f16(b[..., 0:2]) * q + _f16(b[..., 2:4])


def _q8_0(b):
    return b[..., 2:].contiguous().view(torch.int8).float() * _f16(b[..., 0:2])


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of a Q4_K / Q5_K super-block, from its 12 packed bytes."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> 8 sub-blocks of 32: group g's low nibbles are sub-block 2g, its high nibbles 2g + 1."""
    g = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([g & 0x0F, g >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(b):
    sc, mn = _k_scale_min(b[..., 4:16])
    d = (_f16(b[..., 0:2]) * sc.float())[..., None]
    dm = (_f16(b[..., 2:4]) * mn.float())[..., None]
    return d * _k_low_nibbles(b[..., 16:144]).float() - dm


def _q5_k(b):
    sc, mn = _k_scale_min(b[..., 4:16])
    d = (_f16(b[..., 0:2]) * sc.float())[..., None]
    dm = (_f16(b[..., 2:4]) * mn.float())[..., None]
    qh = b[..., 16:48][..., None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]  # sub-block j: bit j
    q = _k_low_nibbles(b[..., 48:176]) | ((qh & 1) << 4)
    return d * q.float() - dm


def _q6_k(b):
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=-2).reshape(*lead, 8, 32)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    qh = (qh & 3).reshape(*lead, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(*lead, 16, 16).float()
    d = (_f16(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float())[..., None]
    return d * q


_DEQUANT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
            "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Symmetric per-output-channel int8 (absmax / 127, round to nearest) of a dense [N, K] weight."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantWeight(q, "I8", tuple(w.shape), scales.contiguous())
