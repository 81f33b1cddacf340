"""The quantized matmul (kernels/quant.py, cpu/quant/) against dequantize-then-torch.matmul, with GGUF's
own quantizer and dequantizer (gguf-py, the code transformers loads GGUF files with) as the reference."""
from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from kernels import quant

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "I8"]
MS = [1, 2, 7, 11, 16, 64, 300]
# Byte offsets of the fp16 scales in a block of the formats gguf-py cannot quantize (the K-quants): random blocks
# get small finite scales there, every other byte (quants, packed 6-bit scales, int8 scales) stays random.
_K_QUANT_F16 = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def make(fmt: str, n: int, k: int, seed: int = 0) -> quant.QuantWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if fmt == "I8":
        return quant.quantize_int8(w)
    if fmt in _K_QUANT_F16:
        rng = np.random.default_rng(seed)
        nb = k // quant.QK_K
        blocks = rng.integers(0, 256, size=(n, nb, quant.BLOCK_BYTES[fmt]), dtype=np.uint8)
        for off in _K_QUANT_F16[fmt]:
            blocks[..., off:off + 2] = (rng.standard_normal((n, nb, 1)) * 0.01).astype(np.float16).view(np.uint8)
        return quant.QuantWeight(torch.from_numpy(blocks.reshape(n, -1)), fmt, (n, k))
    blocks = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, fmt))
    return quant.QuantWeight(torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8).reshape(n, -1)), fmt,
                             (n, k))


def reference_dense(w: quant.QuantWeight) -> torch.Tensor:
    if w.fmt == "I8":
        return w.data.float() * w.scales[:, None]
    qtype = getattr(gguf.GGMLQuantizationType, w.fmt)
    data = w.data.numpy()
    if w.fmt in ("F16", "BF16"):  # gguf-py dequantizes these from their own dtype
        data = data.view(np.float16) if w.fmt == "F16" else data
    deq = gguf.quants.dequantize(data, qtype)
    return torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32)).reshape(w.shape)


def shape_for(fmt: str) -> tuple[int, int]:
    # N is never a multiple of anything; K is not a multiple of 256 wherever the format allows (the 32-wide blocks,
    # F16/BF16, int8), a multiple of the 256-wide super-block for the K-quants.
    if fmt in _K_QUANT_F16:
        return 37, 512
    return (37, 96) if fmt not in ("I8", "F16", "BF16") else (37, 70)


def assert_within_roundoff(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """|got - x @ W^T| within the worst-case fp32 summation error of a K-term dot product, gamma_K * |x| @ |W|^T
    (any summation order stays inside it; the two results each carry at most that much)."""
    expected = x @ dense.T
    k = x.shape[1]
    bound = 2 * (k * 2.0**-24) / (1 - k * 2.0**-24) * (x.abs() @ dense.abs().T) + 1e-30
    assert got.shape == expected.shape
    assert bool(((got - expected).abs() <= bound).all()), float(((got - expected).abs() / bound).max())


def test_the_kernel_builds_here() -> None:
    # The test machines have g++ and ninja; a build failure here is a real regression, not a skip.
    assert quant.available()
    assert quant._module().__name__ == quant.extension_name()
    assert quant.extension_name().startswith("tandem_quant_matmul_")


# Every CPU path: the one this machine takes by default and each narrower one (forced by `isa=`, as TANDEM_CPU_ISA
# forces it for an engine's model through resolve_cpu_path) run here; a wider one is skipped, saying why
# (test_cpu_paths_compile.py still compiles it).
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(
    isa > quant.best_isa(), reason=f"this CPU's kernels go up to {quant.best_isa().label}, not {isa.label}"))
    for isa in quant.CpuIsa]


def test_the_default_path_is_the_widest_this_cpu_has() -> None:
    flags = open("/proc/cpuinfo").read().split()  # x86 Linux: the kernel's own feature flags
    expected = (quant.CpuIsa.AVX512 if {"avx512f", "avx512bw", "avx512vl"} <= set(flags)
                else quant.CpuIsa.AVX2 if {"avx2", "fma", "f16c"} <= set(flags) else quant.CpuIsa.PORTABLE)
    assert quant.best_isa() == expected
    assert quant.default_cpu_path() == quant.CpuPath(expected)  # a call that names no path: auto, float32 wide steps
    assert quant.kernel_path() == expected.label and quant.resolve_cpu_path("auto") == quant.CpuPath(expected)
    assert quant.small_m(expected) == 16
    forced = quant.resolve_cpu_path("portable", 3)  # what the builder does with TANDEM_CPU_ISA and TANDEM_QUANT_SMALL_M
    assert forced == quant.CpuPath(quant.CpuIsa.PORTABLE, 3) and quant.small_m(forced.isa, forced) == 3
    assert quant.kernel_path(forced) == "portable" and not quant.int8_activations_available(forced)
    assert quant.default_cpu_path() == quant.CpuPath(expected)  # resolving a path changed nothing process-wide
    with pytest.raises(ValueError, match="expected auto or one of"):
        quant.resolve_cpu_path("sse9")
    if expected < quant.CpuIsa.AVX512:  # a path this CPU lacks is an error, not a silent downgrade
        with pytest.raises(ValueError, match=f"this CPU's kernels go up to {expected.label}"):
            quant.resolve_cpu_path("avx512")


def test_each_call_routes_by_the_path_it_is_given() -> None:
    """The CPU path is a value each call gets (a model hands its own to every matmul), not process state: a path with
    small_m 3 sends a 5-row step to dequantize + GEMM while the default path keeps it on the in-register kernel, in
    any order of calls, and `register_rows` names each path's width."""
    w = make("Q8_0", 40, 256, seed=5)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5))
    auto, narrow = quant.default_cpu_path(), quant.CpuPath(quant.best_isa(), 3)
    kernel = quant._module().quant_matmul(x, w.data, quant.CPP_FORMATS["Q8_0"], 256, w._scales(), int(auto.isa))
    gemm = quant._dequantize_gemm(x, w)
    assert not torch.equal(kernel, gemm)  # the two routes are told apart by their bits
    for _ in range(2):
        assert torch.equal(quant.matmul(x, w, path=narrow), gemm)
        assert torch.equal(quant.matmul(x, w, path=auto), kernel)
        assert torch.equal(quant.matmul(x, w), kernel)  # no path: the default
    assert torch.equal(quant.matmul(x[:3], w, path=narrow), quant.matmul(x[:3], w, path=auto))  # both: the kernel
    assert quant.register_rows("Q8_0", quant.Activations.AUTO, narrow) == 3
    assert quant.register_rows("Q8_0", quant.Activations.AUTO, auto) == quant.register_rows(
        "Q8_0", quant.Activations.AUTO) == 16


@pytest.mark.parametrize("isa", ISAS, ids=lambda isa: isa.label)
@pytest.mark.parametrize("fmt", list(quant.CPP_FORMATS))
def test_every_cpu_path_dequantizes_bit_identically_and_multiplies_within_roundoff(fmt: str, isa) -> None:
    w = make(fmt, *shape_for(fmt), seed=11)
    dense = reference_dense(w)
    module, code, k = quant._module(), quant.CPP_FORMATS[fmt], w.shape[1]
    assert torch.equal(module.dequantize(w.data, code, k, w._scales(), 0, w.shape[0], int(isa)), dense)
    ids = torch.tensor([4, 0, 36, 4])
    assert torch.equal(module.dequantize_rows(w.data, code, k, w._scales(), ids, int(isa)), dense[ids])
    for m in (1, 3, 4, 5, 8, 13, 16):  # the row tilings: 8, 4, then 3 / 2 / 1 left over; avx512: one tile of m
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        assert_within_roundoff(quant.matmul(x, w, isa=isa), x, dense)


@pytest.mark.parametrize("isa", ISAS, ids=lambda isa: isa.label)
@pytest.mark.parametrize("fmt", list(quant.CPP_FORMATS))
def test_one_row_of_x_gets_the_same_bits_as_that_row_among_others(fmt: str, isa) -> None:
    """Batch 1 and batch 2 take the same arithmetic per row (two accumulators, one reduction), so a chat's tokens do
    not change when a second sequence joins its decode step."""
    k = shape_for(fmt)[1]
    for n in (37, 40, 3):
        w = make(fmt, n, k, seed=n)
        x = torch.randn(2, k, generator=torch.Generator().manual_seed(n))
        assert torch.equal(quant.matmul(x[:1], w, isa=isa), quant.matmul(x, w, isa=isa)[:1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantization_is_bit_identical_to_ggufs(fmt: str) -> None:
    w = make(fmt, *shape_for(fmt))
    dense = reference_dense(w)
    assert torch.equal(w.dequantize(), dense)
    assert torch.equal(w.dequantize(5, 9), dense[5:14])
    assert torch.equal(quant.reference_dequantize(w.data, fmt, w.shape[1], w.scales), dense)
    ids = torch.tensor([[3, 0, 36], [36, 5, 5]])
    assert torch.equal(w.rows(ids), dense[ids])  # the embedding lookup


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", MS)
def test_matmul_matches_dequantize_then_matmul(fmt: str, m: int) -> None:
    w = make(fmt, *shape_for(fmt), seed=m)
    dense = reference_dense(w)
    x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(100 + m))
    assert_within_roundoff(quant.matmul(x, w), x, dense)  # the path the engine takes at this M
    # and both paths at every M: the C++ kernel (formats that have one) and dequantize + GEMM
    if fmt in quant.CPP_FORMATS:
        kernel = quant._module().quant_matmul(x, w.data, quant.CPP_FORMATS[fmt], w.shape[1], w._scales(),
                                              int(quant.default_cpu_path().isa))
        assert_within_roundoff(kernel, x, dense)
    assert_within_roundoff(quant._dequantize_gemm(x, w), x, dense)


@pytest.mark.parametrize("fmt", ["Q4_1", "I8"])
def test_wide_path_in_tiles_of_rows(fmt: str, monkeypatch) -> None:
    monkeypatch.setattr(quant, "TILE_BYTES", 1)  # 64-row tiles: 300 rows are 4 full tiles and a partial one
    w = make(fmt, 300, 64, seed=3)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(4))
    assert_within_roundoff(quant._dequantize_gemm(x, w), x, reference_dense(w))


def test_int8_quantization_is_per_output_channel() -> None:
    w = torch.randn(5, 70) * torch.tensor([1e-3, 1.0, 10.0, 0.0, 3.0])[:, None]
    q = quant.quantize_int8(w)
    assert q.data.dtype == torch.int8 and q.scales.shape == (5,)
    assert int(q.data.abs().max(dim=1).values[[0, 1, 2, 4]].min()) == 127  # every nonzero row uses the full range
    assert torch.equal(q.dequantize()[3], torch.zeros(70))
    err = (q.dequantize() - w).abs()
    assert bool((err <= q.scales[:, None] / 2 + 1e-12).all())  # round to nearest


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 32"):
        quant.QuantWeight(torch.zeros(2, 20, dtype=torch.uint8), "Q4_1", (2, 48))
    with pytest.raises(ValueError, match="blocks must be uint8"):
        quant.QuantWeight(torch.zeros(2, 19, dtype=torch.uint8), "Q4_1", (2, 32))
    with pytest.raises(ValueError, match="unknown"):
        quant.QuantWeight(torch.zeros(2, 20, dtype=torch.uint8), "Q3_K", (2, 32))
    with pytest.raises(ValueError, match="divisible by 256"):
        quant.QuantWeight(torch.zeros(2, 144, dtype=torch.uint8), "Q4_K", (2, 96))


def test_without_the_cpp_build_the_reference_computes(monkeypatch, caplog) -> None:
    """A C++ build that fails logs why, once, and leaves matmul, dequantize and rows correct (torch reference)."""
    from torch.utils import cpp_extension

    def broken(**_):
        raise RuntimeError("Error building extension: g++: command not found")

    quant._module.cache_clear()
    quant.default_cpu_path.cache_clear()  # resolved again by whichever module is built
    try:
        monkeypatch.setattr(cpp_extension, "load", broken)
        with caplog.at_level(logging.WARNING, logger="tandem.kernels"):
            assert not quant.available()
        assert "C++ quantized matmul unavailable" in caplog.text and "command not found" in caplog.text
        for fmt in FORMATS:
            w = make(fmt, *shape_for(fmt))
            dense = reference_dense(w)
            for m in (1, 7, 64):
                x = torch.randn(m, w.shape[1])
                assert_within_roundoff(quant.matmul(x, w), x, dense)
            assert torch.equal(w.dequantize(), dense)
            assert torch.equal(w.rows(torch.tensor([2, 0])), dense[[2, 0]])
    finally:
        monkeypatch.undo()
        quant._module.cache_clear()
        quant.default_cpu_path.cache_clear()
    assert quant.available()


# ---- the fused small ops of the CPU decode step ------------------------------------------------------------


def test_fused_decode_ops_match_torch() -> None:
    from engine.models.decoder_ops import TorchOps

    ops = quant._module()
    g = torch.Generator().manual_seed(5)
    for t in (1, 7, 70):
        x, residual, weight = torch.randn(t, 96, generator=g), torch.randn(t, 96, generator=g), torch.randn(96, generator=g)
        summed = residual + x
        expected = weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5))  # transformers' RMSNorm
        out = ops.add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(residual, summed)  # updated in place
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ops.add_rms_norm(None, summed.clone(), weight, 1e-5), expected, rtol=1e-6, atol=1e-6)
        gate_up = torch.randn(t, 2 * 40, generator=g) * 4
        torch.testing.assert_close(ops.silu_mul(gate_up), torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:],
                                   rtol=1e-6, atol=1e-6)
        qkv = torch.randn(t, 3 + 2 * 1, 16, generator=g)
        cos, sin = torch.randn(t, 16, generator=g), torch.randn(t, 16, generator=g)
        expected_qkv = qkv.clone()
        TorchOps.rotary_(expected_qkv, 4, cos, sin)  # the torch ops the model uses elsewhere
        expected_qk = expected_qkv[:, :4]
        v = qkv[:, 4:].clone()
        ops.rotary_(qkv, 4, cos, sin)
        assert torch.equal(qkv[:, :4], expected_qk)  # same products and sums, each rounded alike
        assert torch.equal(qkv[:, 4:], v)


# ---- int8 activations ----------------------------------------------------------------------------------------


def int8_bound(x: torch.Tensor, dense: torch.Tensor, block: int = 32) -> torch.Tensor:
    """|x W^T - x^ W^T| where x^ is x rounded per block (32 for the 32-wide formats, 256 for the K-quants) to
    dx * round(x / dx), dx = max|x_block| / 127: each element moves by at most dx / 2, so a dot product moves by at
    most sum_b dx_b / 2 * sum_{k in b} |w_k|. Plus the float32 round-off of the products and sums (as
    assert_within_roundoff, on |x| + dx / 2)."""
    m, k = x.shape
    dx = x.abs().view(m, k // block, block).amax(-1) / 127  # [M, K/block]
    half_step = (dx / 2).repeat_interleave(block, dim=1)  # [M, K]
    rounding = half_step @ dense.abs().T
    roundoff = 2 * (k * 2.0**-24) / (1 - k * 2.0**-24) * ((x.abs() + half_step) @ dense.abs().T)
    return rounding + roundoff + 1e-30


# The int8 kernels: AVX2's maddubs (avx2_int8.cpp) on the avx2 path, AVX-512 VNNI (vnni.cpp) on the avx512 path.
INT8_ISAS = [
    pytest.param(quant.CpuIsa.AVX2, id="avx2-maddubs", marks=pytest.mark.skipif(
        quant.best_isa() < quant.CpuIsa.AVX2, reason="this CPU has no AVX2 + FMA + F16C")),
    pytest.param(quant.CpuIsa.AVX512, id="avx512-vnni", marks=pytest.mark.skipif(
        quant.int8_kernel(quant.CpuIsa.AVX512) != "vnni",
        reason="this CPU has no AVX-512 VNNI (an avx512 path without it takes the AVX2 kernel, tested as avx2)")),
]


# The K-quants' int8 kernels: avx2_int8.cpp's row_k8 (AVX2's maddubs, 32 bytes a step) on the avx2 path and
# avx512_k8.cpp (the same at 64 bytes, AVX-512 BW; no VNNI needed) on the avx512 path.
KQ_INT8_ISAS = [
    INT8_ISAS[0],
    pytest.param(quant.CpuIsa.AVX512, id="avx512-k8", marks=pytest.mark.skipif(
        quant.best_isa() < quant.CpuIsa.AVX512, reason="this CPU has no AVX-512 F + BW + VL")),
]


def quantize_x_like_the_kernels(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x rounded per block of 32 (256) as formats.h quantize_block32 (quantize_block256) does, in float32: dx =
    max|x| / 127, q = round(x * (127 / max|x|)) to nearest even, x^ = dx * q."""
    m, k = x.shape
    blocks = x.view(m, k // block, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (amax / 127 * torch.round(blocks * inv)).view(m, k)


# Per format: the byte offsets of the fp16 d and min of a block, and the offset c the VNNI kernel adds to make the
# weights unsigned bytes u (w = d * (u - c) + m).
_INT8_LAYOUT = {"Q4_0": (0, None, 8), "Q4_1": (0, 2, 0), "Q5_0": (0, None, 16), "Q5_1": (0, 2, 0), "Q8_0": (0, None, 128)}


def int8_magnitudes(w: quant.QuantWeight) -> torch.Tensor:
    """A_k = |d| (u_k + c) + |m| per weight: what bounds the terms either int8 kernel sums in float32 (AVX2's
    d (q - c) or d q and m, VNNI's d u and (m - c d)), even where w_k = d (u - c) + m cancels to ~0. u comes from
    the blocks with d set to 1 and the min to 0, dequantized by the reference (u - c, exactly)."""
    d_off, m_off, c = _INT8_LAYOUT[w.fmt]
    n, k = w.shape
    blocks = w.data.view(n, k // 32, quant.BLOCK_BYTES[w.fmt]).clone()
    d = blocks[..., d_off:d_off + 2].contiguous().view(torch.float16).float()  # [n, nb, 1]
    mn = blocks[..., m_off:m_off + 2].contiguous().view(torch.float16).float() if m_off is not None else 0 * d
    blocks[..., d_off:d_off + 2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    if m_off is not None:
        blocks[..., m_off:m_off + 2] = 0
    u = quant.reference_dequantize(blocks.view(n, -1), w.fmt, k).view(n, k // 32, 32) + c
    return (d.abs() * (u + c) + mn.abs()).view(n, k)


def int8_kquant_magnitudes(w: quant.QuantWeight) -> torch.Tensor:
    """A_k for a K-quant: the magnitudes of the two terms the int8 kernels scale and add in float32, |d sc_j| q_k
    and |dmin m_j| (Q4_K, Q5_K: the reference with dmin zeroed, then with d zeroed), or for Q6_K |d sc_j| (q_k + 32):
    row_k8 adds d sc_j (q_k - 32) (|w_k|, less), avx512_k8 d sc_j q_k and the offset 32 d sc_j as two terms. |d sc_j|
    is what the reference gives with every quant set to 0 (w = -32 d sc_j), divided by 32; q_k - 32 what it gives
    with d and every sub-block scale set to 1."""
    n, k = w.shape
    if w.fmt == "Q6_K":
        blocks = w.data.view(n, k // quant.QK_K, quant.BLOCK_BYTES["Q6_K"])
        zero_q, unit_scales = blocks.clone(), blocks.clone()
        zero_q[..., :192] = 0  # ql and qh: q = 0
        unit_scales[..., 192:208] = 1
        unit_scales[..., 208:210] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
        dsc = quant.reference_dequantize(zero_q.view(n, -1), "Q6_K", k).abs() / 32
        q = quant.reference_dequantize(unit_scales.view(n, -1), "Q6_K", k) + 32
        return dsc * (q + 32)
    blocks = w.data.view(n, k // quant.QK_K, quant.BLOCK_BYTES[w.fmt])
    blocks = w.data.view(n, k // quant.QK_K, quant.BLOCK_BYTES[w.fmt])
    parts = []
    for zero in (2, 0):  # dmin zeroed: d sc q; d zeroed: -dmin m
        b = blocks.clone()
        b[..., zero:zero + 2] = 0
        parts.append(quant.reference_dequantize(b.view(n, -1), w.fmt, k).abs())
    return parts[0] + parts[1]


def int8_roundoff_bound(xq: torch.Tensor, w: quant.QuantWeight, magnitudes=None) -> torch.Tensor:
    """|kernel - x^ @ dense^T| where x^ is x rounded as the kernels round it (so the integer sums are exact): the
    kernel rounds d * dx, its product with the block's integer sum and the min term (a few roundings per block),
    then sums K / 32 blocks in lanes; the reference rounds x^ = dx * q, w = d * q + m and K products and sums. Each
    side is within gamma_{K + 8} (|x^| @ A^T) (int8_magnitudes), so their difference within twice that."""
    k = xq.shape[1] + 8
    a = int8_magnitudes(w) if magnitudes is None else magnitudes
    return 2 * (k * 2.0**-24) / (1 - k * 2.0**-24) * (xq.abs() @ a.T) + 1e-30


@pytest.mark.parametrize("isa", INT8_ISAS)
@pytest.mark.parametrize("fmt", quant.INT8_BLOCK32)
def test_int8_activations_stay_within_the_bound_of_rounding_x_to_8_bits(fmt: str, isa) -> None:
    assert quant.int8_kernel(isa) == {quant.CpuIsa.AVX2: "avx2", quant.CpuIsa.AVX512: "vnni"}[isa]
    for k in (96, 64):  # an odd number of blocks (a half pair for VNNI) and an even one
        w = make(fmt, 37, k, seed=k)
        dense = reference_dense(w)
        for m in (1, 3, 4, 6, 10):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.linspace(0.01, 3, k)
            x[0, :32] = 0.0  # an all-zero block (dx = 0)
            got = quant.matmul(x, w, isa=isa, activations=quant.Activations.INT8)
            # against float32 x: the rounding of x to 8 bits plus round-off
            assert bool(((got - x @ dense.T).abs() <= int8_bound(x, dense)).all())
            # against gguf-py's weights times x rounded as the kernel rounds it: float32 round-off only
            xq = quantize_x_like_the_kernels(x)
            err = (got - xq @ dense.T).abs()
            bound = int8_roundoff_bound(xq, w)
            assert bool((err <= bound).all()), float((err / bound).max())
            # and it is the int8 path, not the float32 one: the results differ where x is not on the 8-bit grid
            assert not torch.equal(got, quant.matmul(x, w, isa=isa))


@pytest.mark.parametrize("isa", INT8_ISAS)
@pytest.mark.parametrize("fmt", quant.INT8_FORMATS)
def test_int8_one_row_of_x_gets_the_same_bits_as_that_row_among_others(fmt: str, isa) -> None:
    w = make(fmt, 37, 256, seed=5)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(6))
    many = quant.matmul(x, w, isa=isa, activations=quant.Activations.INT8)
    for r in (0, 5):
        assert torch.equal(quant.matmul(x[r:r + 1], w, isa=isa, activations=quant.Activations.INT8), many[r:r + 1])


@pytest.mark.skipif(quant.int8_kernel(quant.CpuIsa.AVX512) != "vnni",
                    reason="needs both int8 kernels: this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("fmt", quant.INT8_BLOCK32)
def test_the_avx2_int8_kernel_equals_the_vnni_one_up_to_roundoff(fmt: str) -> None:
    """Both kernels multiply the same integers (one quantizer, formats.h quantize_block32) and sum them exactly;
    they differ in how the float32 scale and offset terms are added, so by round-off only, never by a rounding of
    x (which would be some dx / 2 * |w| away)."""
    w = make(fmt, 64, 2048, seed=7)  # Gemma 3's widest K
    x = torch.randn(5, 2048, generator=torch.Generator().manual_seed(7))
    int8 = quant.Activations.INT8
    avx2 = quant.matmul(x, w, isa=quant.CpuIsa.AVX2, activations=int8)
    vnni = quant.matmul(x, w, isa=quant.CpuIsa.AVX512, activations=int8)
    xq = quantize_x_like_the_kernels(x)
    assert bool(((avx2 - vnni).abs() <= int8_roundoff_bound(xq, w)).all())
    assert not torch.equal(avx2, quant.matmul(x, w, isa=quant.CpuIsa.AVX2))  # neither is the float32 result


@pytest.mark.parametrize("isa", KQ_INT8_ISAS)
@pytest.mark.parametrize("fmt", quant.INT8_KQUANTS)
def test_int8_kquants_stay_within_the_bound_of_rounding_x_to_8_bits_per_super_block(fmt: str, isa) -> None:
    """The K-quants with x rounded per super-block of 256 (llama.cpp's Q8_K: one dx per 256, sums per 16 for the
    mins). The integer sums per super-block are exact and every int32 lane converted to float stays below 2^24
    (avx2_int8.cpp row_k8, avx512_k8.cpp), so a kernel rounds only d * dx, one fma per term and super-block and the
    final sum of lanes: against
    gguf-py's weights times x rounded as the kernel rounds it, within 2 gamma_{K + 8} |x^| @ A^T as the 32-wide
    formats (int8_roundoff_bound), with A the magnitudes of the terms it adds (int8_kquant_magnitudes)."""
    for k in (256, 512):
        w = make(fmt, 37, k, seed=k + 1)
        dense = reference_dense(w)
        for m in (1, 3, 4, 6, 10):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.linspace(0.01, 3, k)
            if k > 256:
                x[0, :256] = 0.0  # an all-zero super-block (dx = 0) beside one that is not
            got = quant.matmul(x, w, isa=isa, activations=quant.Activations.INT8)
            assert bool(((got - x @ dense.T).abs() <= int8_bound(x, dense, 256)).all())
            xq = quantize_x_like_the_kernels(x, 256)
            err = (got - xq @ dense.T).abs()
            bound = int8_roundoff_bound(xq, w, int8_kquant_magnitudes(w))
            assert bool((err <= bound).all()), float((err / bound).max())
            assert not torch.equal(got, quant.matmul(x, w, isa=isa))  # the int8 path, not the float32 one


# (path, host): each K-quant int8 path on this host, and the avx2 one on this host taken for one without AVX-512
KQ_WIDTH_CASES = [pytest.param(p.values[0], "this", id=p.id, marks=p.marks) for p in KQ_INT8_ISAS] + [
    pytest.param(INT8_ISAS[0].values[0], "avx2-only", id="avx2-maddubs-on-an-avx2-only-host",
                 marks=INT8_ISAS[0].marks)]


@pytest.mark.parametrize(("isa", "host"), KQ_WIDTH_CASES)
@pytest.mark.parametrize("fmt", quant.INT8_KQUANTS)
def test_the_kquant_int8_kernel_takes_steps_past_small_m_up_to_its_own_width(fmt: str, isa, host: str,
                                                                             monkeypatch) -> None:
    """The K-quants' int8 kernels beat dequantize + GEMM to more rows than the float32 kernels (`quant.int8_rows`: 64
    with VNNI, 32 for the avx2 kernel beside an AVX-512 GEMM, every width on a host without AVX-512, whose GEMM is
    AVX2: "avx2-only" makes this host one): a step of small_m + 1 rows and one of the widest the kernel takes (300
    when it takes every width) multiply int8-rounded rows (within the rounding bound, each row what it gets alone,
    not the float32 result); one row more goes to the GEMM (the float32 result, bit for bit); 32-wide formats and
    float32 activations stop at small_m."""
    if host == "avx2-only":
        monkeypatch.setattr(quant, "best_isa", lambda: quant.CpuIsa.AVX2)
    wide = quant.int8_rows(isa, fmt)
    if quant.int8_kernel(isa) == "vnni":
        assert wide == 64
    else:
        assert wide == (32 if quant.best_isa() >= quant.CpuIsa.AVX512 else None)
    assert quant.int8_rows(isa, "Q8_0") == quant.small_m(isa)
    w = make(fmt, 40, 512, seed=3)
    dense = reference_dense(w)
    int8 = quant.Activations.INT8
    for m in (quant.small_m(isa) + 1, wide or 300):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        got = quant.matmul(x, w, isa=isa, activations=int8)
        xq = quantize_x_like_the_kernels(x, 256)
        assert bool(((got - xq @ dense.T).abs() <= int8_roundoff_bound(xq, w, int8_kquant_magnitudes(w))).all())
        for r in (0, m // 2, m - 1):
            assert torch.equal(quant.matmul(x[r:r + 1], w, isa=isa, activations=int8), got[r:r + 1])
        assert not torch.equal(got, quant.matmul(x, w, isa=isa))  # the int8 kernel, not the float32 path
    if wide is not None:
        x = torch.randn(wide + 1, 512, generator=torch.Generator().manual_seed(1))
        assert torch.equal(quant.matmul(x, w, isa=isa, activations=int8), quant.matmul(x, w, isa=isa))


@pytest.mark.skipif(quant.best_isa() < quant.CpuIsa.AVX512, reason="needs both K-quant int8 kernels: this CPU has "
                    "no AVX-512 F + BW + VL")
@pytest.mark.parametrize("fmt", quant.INT8_KQUANTS)
def test_the_avx512_kquant_int8_kernel_equals_the_avx2_one_up_to_roundoff(fmt: str) -> None:
    """Both K-quant kernels multiply the same integers (one quantizer, formats.h quantize_block256) and sum them
    exactly; they add the float32 terms in other orders (and avx512_k8 takes Q6_K's offset as a term of its own),
    so they differ by round-off only, never by a rounding of x. At 1.7B's K (2048) and its down projection's (8192),
    1 to 5 rows (the tiles of 4 and the rest)."""
    int8 = quant.Activations.INT8
    for k in (2048, 8192):
        w = make(fmt, 24, k, seed=9)
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(9))
        x[1, 256:512] = 0.0  # an all-zero super-block
        avx2 = quant.matmul(x, w, isa=quant.CpuIsa.AVX2, activations=int8)
        avx512 = quant.matmul(x, w, isa=quant.CpuIsa.AVX512, activations=int8)
        xq = quantize_x_like_the_kernels(x, 256)
        bound = int8_roundoff_bound(xq, w, int8_kquant_magnitudes(w))
        assert bool(((avx2 - avx512).abs() <= bound).all()), float(((avx2 - avx512).abs() / bound).max())
        assert not torch.equal(avx512, quant.matmul(x, w, isa=quant.CpuIsa.AVX512))  # not the float32 result


def test_int8_activations_leave_other_formats_on_float32() -> None:
    w = make("I8", 37, 512)
    x = torch.randn(2, 512)
    assert torch.equal(quant.matmul(x, w, activations=quant.Activations.INT8), quant.matmul(x, w))


@pytest.mark.parametrize("isa", INT8_ISAS)
def test_an_int8_walker_projection_is_its_parts_int8_products_side_by_side(isa) -> None:
    """A walker projection with int8 activations quantizes x once per call (per 32 for the Q5_0 / Q8_0 parts, per
    256 for the Q4_K part) and gives each part's columns bit for bit what `matmul` with int8 gives that part; I8
    parts keep float32."""
    int8 = quant.Activations.INT8
    parts = [make("Q4_K", 40, 256, seed=1), make("Q5_0", 24, 256, seed=2), make("Q8_0", 24, 256, seed=3),
             make("I8", 8, 256, seed=4)]
    x = torch.randn(3, 256)
    got = quant.projection(parts, None, int8)(x, int(isa))
    expected = torch.cat([quant.matmul(x, w, isa=isa, activations=int8) for w in parts], dim=1)
    assert torch.equal(got, expected)
    assert not torch.equal(got, quant.projection(parts)(x, int(isa)))


@pytest.mark.parametrize("isa", INT8_ISAS)
def test_auto_activations_take_int8_for_the_kquants_and_float32_for_the_rest(isa) -> None:
    """Activations.AUTO (the engine's default): a K-quant multiplies int8 activations (the INT8 result, bit for bit),
    a 32-wide format and I8 float32 ones (the FLOAT32 result); a walker projection mixing them gives each part's
    columns what `matmul` with AUTO gives that part (x quantized per 256 only, for the Q4_K / Q6_K parts)."""
    auto, int8, f32 = quant.Activations.AUTO, quant.Activations.INT8, quant.Activations.FLOAT32
    parts = [make("Q4_K", 40, 256, seed=1), make("Q5_0", 24, 256, seed=2), make("Q6_K", 16, 256, seed=5),
             make("Q8_0", 24, 256, seed=3), make("I8", 8, 256, seed=4)]
    x = torch.randn(3, 256)
    for w in parts:
        want = int8 if w.fmt in quant.INT8_KQUANTS else f32
        assert quant.takes_int8(auto, w.fmt) == (want is int8)
        assert torch.equal(quant.matmul(x, w, isa=isa, activations=auto), quant.matmul(x, w, isa=isa, activations=want))
    got = quant.projection(parts, None, auto)(x, int(isa))
    assert torch.equal(got, torch.cat([quant.matmul(x, w, isa=isa, activations=auto) for w in parts], dim=1))
    assert not torch.equal(got[:, :40], quant.projection(parts[:1])(x, int(isa)))  # the Q4_K columns are int8's


def test_auto_activations_on_the_portable_path_stay_float32() -> None:
    """The portable path has no int8 kernel: AUTO (and INT8) multiply float32 activations there, K-quants included."""
    w = make("Q4_K", 16, 512, seed=6)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(6))
    f32 = quant.matmul(x, w, isa=quant.CpuIsa.PORTABLE)
    for act in (quant.Activations.AUTO, quant.Activations.INT8):
        assert torch.equal(quant.matmul(x, w, isa=quant.CpuIsa.PORTABLE, activations=act), f32)
        assert torch.equal(quant.projection([w], None, act)(x, int(quant.CpuIsa.PORTABLE)), f32)


@pytest.mark.parametrize("isa", ISAS, ids=lambda isa: isa.label)
def test_a_walker_projection_is_its_parts_side_by_side_plus_the_bias(isa) -> None:
    """The layer walker's projection (cpu/quant/layer_walker.h `Projection`): parts stored in different formats (a q/k/v
    whose parts could not be fused, as in Gemma 3's file) fill their own columns of one output, bit for bit what
    `matmul` gives each part, then the bias is added."""
    parts = [make("Q4_K", 40, 256, seed=1), make("Q5_0", 24, 256, seed=2), make("Q8_0", 24, 256, seed=3)]
    bias = torch.randn(88)
    x = torch.randn(3, 256)
    got = quant.projection(parts, bias)(x, int(isa))
    expected = torch.cat([quant.matmul(x, w, isa=isa) for w in parts], dim=1) + bias
    assert torch.equal(got, expected)
    assert torch.equal(quant.projection(parts[:1])(x, int(isa)), quant.matmul(x, parts[0], isa=isa))


def test_the_walker_refuses_what_does_not_fit() -> None:
    with pytest.raises(RuntimeError, match="float32 bias of N"):
        quant.projection([make("Q8_0", 8, 64)], torch.zeros(7))
    with pytest.raises(RuntimeError, match="contiguous \\[M, K\\] input"):
        quant.projection([make("Q8_0", 8, 64)])(torch.zeros(2, 32), int(quant.default_cpu_path().isa))
    walker = quant.decode_layers(num_heads=2, num_kv_heads=1, head_dim=16, eps=1e-6, gelu=False)
    assert walker is not None and walker.num_layers() == 0
    qkv, o = quant.projection([make("Q8_0", 64, 32)]), quant.projection([make("Q8_0", 32, 32)])
    up, down = quant.projection([make("Q8_0", 128, 32)]), quant.projection([make("Q8_0", 32, 64)])
    norm = torch.ones(32)
    with pytest.raises(RuntimeError, match="do not fit the heads"):  # q/k/v needs (2 + 2 * 1) heads of 16 = 64 rows
        walker.add_layer(o, o, up, down, None, None, None, norm, None, norm, 0.25, 0, 0.0, 0)
    walker.add_layer(qkv, o, up, down, None, None, None, norm, None, norm, 0.25, 0, 0.0, 0)
    assert walker.num_layers() == 1
    with pytest.raises(RuntimeError, match="kv_caches must be"):  # a cache for two layers
        walker.forward(torch.zeros(1, 32), torch.zeros(1, 32), torch.zeros(2, 2, 4, 16, 1, 16), [torch.zeros(1, 16)],
                       [torch.zeros(1, 16)], torch.zeros(1, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int32),
                       torch.ones(1, dtype=torch.int32), int(quant.default_cpu_path().isa))
    import datetime  # its C API is a PyCapsule of another name

    with pytest.raises(RuntimeError, match="must be a tandem.paged_decode_qkv capsule"):
        quant._module().DecodeLayers(2, 1, 16, 1e-6, False, datetime.datetime_CAPI)


# ---- the wide int8 GEMM (prefill chunks with int8 activations; avx2_int8.cpp gemm_int8_avx2) ---------------------


@pytest.mark.skipif(quant.best_isa() < quant.CpuIsa.AVX2, reason="this CPU has no AVX2 + FMA + F16C")
@pytest.mark.parametrize("fmt", quant.GEMM_INT8_FORMATS)
def test_the_wide_int8_gemm_stays_within_the_bound_and_agrees_with_the_row_kernel(fmt: str) -> None:
    isa = quant.CpuIsa.AVX2
    assert quant.gemm_int8(isa, fmt)
    module = quant._module()
    for k, n in ((96, 37), (64, 16)):  # rows of W not a multiple of the 8-row groups, and a multiple
        w = make(fmt, n, k, seed=k)
        dense = reference_dense(w)
        for m in (17, 70, 300):  # past small_m; a tile of 1-3 rows left over; several 64-row chunks of x
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.linspace(0.01, 3, k)
            x[0, :32] = 0.0  # an all-zero block (dx = 0)
            got = quant.matmul(x, w, isa=isa, activations=quant.Activations.INT8)
            assert torch.equal(got, module.quant_gemm_int8(x, w.data, quant.CPP_FORMATS[fmt], k, int(isa)))
            assert bool(((got - x @ dense.T).abs() <= int8_bound(x, dense)).all())
            xq = quantize_x_like_the_kernels(x)
            err = (got - xq @ dense.T).abs()
            bound = int8_roundoff_bound(xq, w)
            assert bool((err <= bound).all()), float((err / bound).max())
            # the same integers as the small-M int8 kernel: the two differ by float32 round-off only
            rows = module.quant_matmul_int8(x, w.data, quant.CPP_FORMATS[fmt], k, int(isa))
            assert bool(((got - rows).abs() <= 2 * bound).all())
            # one row's result does not depend on the rows beside it
            assert torch.equal(quant.matmul(x[:20], w, isa=isa, activations=quant.Activations.INT8), got[:20])


@pytest.mark.skipif(quant.best_isa() < quant.CpuIsa.AVX2, reason="this CPU has no AVX2 + FMA + F16C")
@pytest.mark.parametrize("fmt", ["Q4_1", "Q5_0"])  # the two assembly tiles: one int32 sum per block, and two
def test_the_wide_int8_gemm_tiles_of_16_columns_fill_a_partial_second_group_and_rows_left_over(fmt: str) -> None:
    # the tiles take two 8-row groups of W at once: N = 12 and 28 end in a pair whose second group has 4 rows,
    # N = 8 is one group alone; M = 137, 81, 83, 84 leave 2, 1, 3, 4 rows past Q4's whole 5-row tiles (80-row chunks)
    # and 2, 0, 2, 0 past Q5's 3-row ones (48-row chunks)
    isa = quant.CpuIsa.AVX2
    module = quant._module()
    for m in (137, 81, 83, 84):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        xq = quantize_x_like_the_kernels(x)
        for n in (12, 28, 8):
            w = make(fmt, n, 64, seed=n)
            got = module.quant_gemm_int8(x, w.data, quant.CPP_FORMATS[fmt], 64, int(isa))
            bound = int8_roundoff_bound(xq, w)
            assert bool(((got - xq @ reference_dense(w).T).abs() <= bound).all())
            rows = module.quant_matmul_int8(x, w.data, quant.CPP_FORMATS[fmt], 64, int(isa))
            assert bool(((got - rows).abs() <= 2 * bound).all())


def test_the_wide_int8_gemm_is_taken_on_the_avx2_path_only_and_not_for_other_formats() -> None:
    for fmt in quant.GEMM_INT8_FORMATS:
        assert not quant.gemm_int8(quant.CpuIsa.PORTABLE, fmt)
        assert not quant.gemm_int8(quant.CpuIsa.AVX512, fmt)  # MKL's 16-lane GEMM or the bf16 one there
    for fmt in ("Q8_0", "Q4_K", "Q6_K", "I8", "F16"):
        assert not quant.gemm_int8(quant.CpuIsa.AVX2, fmt)
    if quant.best_isa() >= quant.CpuIsa.AVX2:  # float32 activations keep the float32 GEMM at every width
        w = make("Q4_1", 24, 64)
        x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
        got = quant.matmul(x, w, isa=quant.CpuIsa.AVX2)
        assert_within_roundoff(got, x, reference_dense(w))
        assert not torch.equal(got, quant.matmul(x, w, isa=quant.CpuIsa.AVX2, activations=quant.Activations.INT8))


def test_the_prefill_path_names_how_each_format_is_multiplied_in_a_wide_step() -> None:
    if not quant.available():
        assert quant.prefill_path(None, quant.Activations.AUTO, ["Q4_1"]) == ""
        return
    for isa in [i for i in quant.CpuIsa if i <= quant.best_isa()]:
        path = quant.CpuPath(isa)
        assert quant.prefill_path(path, quant.Activations.FLOAT32, ["Q4_1"]) == (
            f"Q4_1 float32 dequantize + BLAS GEMM ({isa.label})")
        named = quant.prefill_path(path, quant.Activations.INT8, ["Q4_1", "Q8_0"])
        if isa is quant.CpuIsa.AVX2:
            assert named == "Q4_1 int8 GEMM, Q8_0 float32 dequantize + BLAS GEMM (avx2)"
        assert quant.prefill_path(path, quant.Activations.AUTO, []) == ""
