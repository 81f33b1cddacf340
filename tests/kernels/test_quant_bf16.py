"""The quantized matmul's bf16 wide path (kernels/quant.py `_bf16_gemm`, cpu/quant `dequantize_bf16`): steps wider
than the in-register kernels take, with reduced-precision activations, on a CPU whose oneDNN multiplies bf16
natively. References: gguf-py's dequantizer (tests/kernels/test_quant.py `reference_dense`) and torch's own
float32 -> bfloat16 rounding."""
from __future__ import annotations

import pytest
import torch

from kernels import quant
from kernels.linear import native_bf16
from tests.kernels.test_quant import ISAS, make, reference_dense, shape_for

AUTO, INT8, F32 = quant.Activations.AUTO, quant.Activations.INT8, quant.Activations.FLOAT32
NEEDS_BF16 = pytest.mark.skipif(not quant.bf16_gemm_available(quant.CpuIsa.AVX512) or quant.best_isa()
                                < quant.CpuIsa.AVX512, reason="this CPU has no native bf16 GEMM on an AVX-512 path "
                                "(AVX512_BF16 or AMX): the wide steps stay float32 here")


@pytest.mark.parametrize("isa", ISAS, ids=lambda isa: isa.label)
@pytest.mark.parametrize("fmt", list(quant.CPP_FORMATS))
def test_dequantize_bf16_is_ggufs_values_rounded_as_torch_rounds_them(fmt: str, isa) -> None:
    """Every C++ format on every CPU path this host has: the bf16 tile is exactly gguf-py's float32 values through
    torch's `.to(torch.bfloat16)` (round to nearest even), for a whole matrix and for a slice of rows. Compared as
    values, as the float32 dequantizer is: its AVX-512 path gives +0 where gguf-py's arithmetic gives -0."""
    w = make(fmt, *shape_for(fmt), seed=21)
    want = reference_dense(w).to(torch.bfloat16)
    module, code, k = quant._module(), quant.CPP_FORMATS[fmt], w.shape[1]
    got = module.dequantize_bf16(w.data, code, k, w._scales(), 0, w.shape[0], int(isa))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    part = module.dequantize_bf16(w.data, code, k, w._scales(), 5, 9, int(isa))
    assert torch.equal(part, want[5:14])
    with pytest.raises(RuntimeError, match="rows out of range"):
        module.dequantize_bf16(w.data, code, k, w._scales(), 30, 9, int(isa))


def test_the_rounding_keeps_ties_even_and_nan_a_nan() -> None:
    """The C++ rounding, on values whose low 16 bits are exactly half way (ties to even), just past it, and a NaN,
    through an F16-free path: an I8 weight whose scale makes those values."""
    tie_down = torch.tensor([1.0 + 2.0**-8], dtype=torch.float32)  # 0x3F808000: a tie, rounds to the even 0x3F80
    tie_up = torch.tensor([1.0 + 3 * 2.0**-8], dtype=torch.float32)  # 0x3F818000: a tie, rounds up to 0x3F82
    past = torch.tensor([1.0 + 2.0**-8 + 2.0**-20], dtype=torch.float32)
    values = torch.cat([tie_down, tie_up, past, torch.tensor([float("nan"), -0.0, 3.0e38])])
    w = quant.QuantWeight(torch.ones(values.numel(), 1, dtype=torch.int8), "I8", (values.numel(), 1), values)
    got = quant._module().dequantize_bf16(w.data, quant.CPP_FORMATS["I8"], 1, w.scales, 0, values.numel(),
                                          int(quant.CpuIsa.PORTABLE)).float().view(-1)
    want = values.to(torch.bfloat16).float()
    assert torch.equal(got[:3], want[:3]) and got[0] == 1.0 and got[1] == 1.0 + 2.0**-6
    assert torch.isnan(got[3]) and torch.equal(got[4:], want[4:])


def bf16_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """|got - x @ W^T| when x and W are each rounded to bf16 (relative 2^-9 each, so 2^-8 + 2^-18 a product),
    summed in float32 (gamma_K) and the sum rounded to bf16 once (2^-9 of it): a worst case per output."""
    k = x.shape[1]
    gamma = (k * 2.0**-24) / (1 - k * 2.0**-24)
    magnitude = x.abs() @ dense.abs().T
    return (2.0**-8 + 2.0**-17 + gamma) * magnitude * (1 + 2.0**-8) + 2.0**-9 * (x @ dense.T).abs() + 1e-30


@NEEDS_BF16
@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0", "Q5_1"])
def test_wide_steps_multiply_bf16_within_the_bound_of_rounding_x_and_w(fmt: str, monkeypatch) -> None:
    """A step wider than the int8 kernel takes: bf16 (within the bound, and not the float32 result) with int8 and,
    for the K-quants, auto activations; float32 activations stay float32 bit for bit. In tiles of weight rows (a
    tile smaller than N) and in one piece."""
    n, k = 300, 512
    w = make(fmt, n, k, seed=4)
    dense = reference_dense(w)
    isa = quant.CpuIsa.AVX512
    m = max(quant.int8_rows(isa, fmt, True) or 0, quant.int8_rows(isa, fmt, False) or 0) + 7  # past both widths
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)) * torch.linspace(0.05, 2, k)
    float32 = quant._dequantize_gemm(x, w)
    for tile in (quant.BF16_TILE_BYTES, 64 * 2 * k):  # one tile, then five (the last one short)
        monkeypatch.setattr(quant, "BF16_TILE_BYTES", tile)
        for act in (INT8, AUTO) if fmt in quant.INT8_KQUANTS else (INT8,):
            got = quant.matmul(x, w, isa=isa, activations=act, bf16=True)
            err = (got - x @ dense.T).abs()
            assert got.dtype == torch.float32 and got.shape == (m, n)
            assert bool((err <= bf16_bound(x, dense)).all()), float((err / bf16_bound(x, dense)).max())
            assert not torch.equal(got, float32)
        assert torch.equal(quant.matmul(x, w, isa=isa, activations=F32, bf16=True), float32)
        assert torch.equal(quant.matmul(x, w, isa=isa, activations=INT8, bf16=False), float32)
    if fmt not in quant.INT8_KQUANTS:  # auto keeps the 32-wide formats float32 at every width
        assert torch.equal(quant.matmul(x, w, isa=isa, activations=AUTO, bf16=True), float32)


@NEEDS_BF16
def test_steps_the_int8_kernel_takes_stay_int8_beside_the_bf16_path() -> None:
    """Up to `int8_rows` rows a K-quant step is the int8 kernel's (each row what it gets alone, whatever `bf16`);
    the next row count goes to the bf16 GEMM."""
    w = make("Q4_K", 40, 512, seed=8)
    isa = quant.CpuIsa.AVX512
    wide = quant.int8_rows(isa, "Q4_K", True)
    x = torch.randn(wide + 1, 512, generator=torch.Generator().manual_seed(8))
    inside = quant.matmul(x[:wide], w, isa=isa, activations=AUTO, bf16=True)
    assert torch.equal(inside, quant.matmul(x[:wide], w, isa=isa, activations=AUTO, bf16=False))
    assert torch.equal(inside[:1], quant.matmul(x[:1], w, isa=isa, activations=AUTO, bf16=True))
    past = quant.matmul(x, w, isa=isa, activations=AUTO, bf16=True)
    assert torch.equal(past, quant._bf16_gemm(quant._module(), x, w, isa))
    # a path with bf16 wide steps (a model's, built with native bf16) takes them without being told per call
    assert torch.equal(quant.matmul(x, w, activations=AUTO, path=quant.CpuPath(isa, None, True)), past)


def test_which_paths_take_the_bf16_path(monkeypatch) -> None:
    """`CpuPath.bf16_gemm`: the AVX-512 path on a CPU with native bf16, where the builder asks for it
    (Settings.native_bf16); never a forced narrower path, a CPU without native bf16, or a call that names no path
    (`default_cpu_path`); `matmul`'s default follows the path it is given (`_bf16_wide`), and a call forcing a
    narrower `isa` stays float32."""
    monkeypatch.setattr(quant, "best_isa", lambda: quant.CpuIsa.AVX512)
    for native in (True, False):
        monkeypatch.setattr("kernels.linear.native_bf16", lambda native=native: native)
        assert quant.bf16_gemm_available(quant.CpuIsa.AVX512) is native
        assert not quant.bf16_gemm_available(quant.CpuIsa.AVX2)
        assert quant.resolve_cpu_path("auto", None, True).bf16_gemm is native
        assert quant.resolve_cpu_path("auto", None, False).bf16_gemm is False
        assert quant.resolve_cpu_path("avx2", None, True).bf16_gemm is False
        assert quant.resolve_cpu_path().bf16_gemm is False  # asked for nothing: float32 wide steps
    bf16 = quant.CpuPath(quant.CpuIsa.AVX512, None, True)
    assert quant._bf16_wide(bf16, quant.CpuIsa.AVX512) and not quant._bf16_wide(bf16, quant.CpuIsa.AVX2)
    assert not quant._bf16_wide(quant.CpuPath(quant.CpuIsa.AVX512), quant.CpuIsa.AVX512)


def test_amx_lowers_the_kquant_int8_width_only_beside_the_bf16_path(monkeypatch) -> None:
    """With AMX tiles behind the wide steps the VNNI K-quant kernel hands over at `_INT8_KQUANT_M_AMX` rows; without
    AMX, or with the wide steps float32, at `_INT8_KQUANT_M`."""
    monkeypatch.setattr(quant, "int8_kernel", lambda isa=None: "vnni")
    monkeypatch.setattr(quant, "best_isa", lambda: quant.CpuIsa.AVX512)
    for amx in (True, False):
        monkeypatch.setattr(quant, "amx", lambda amx=amx: amx)
        widest = quant._INT8_KQUANT_M_AMX if amx else quant._INT8_KQUANT_M
        assert quant.int8_rows(quant.CpuIsa.AVX512, "Q4_K", True) == max(16, widest["vnni"])
        assert quant.int8_rows(quant.CpuIsa.AVX512, "Q4_K", False) == quant._INT8_KQUANT_M["vnni"]
        assert quant.int8_rows(quant.CpuIsa.AVX512, "Q8_0", True) == quant.small_m(quant.CpuIsa.AVX512)


def test_native_bf16_names_what_the_cpu_reports() -> None:
    flags = set(open("/proc/cpuinfo").read().split())
    assert native_bf16() == bool(torch.backends.mkldnn.is_available() and flags & {"avx512_bf16", "amx_bf16"})
