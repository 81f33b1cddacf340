"""kernels.linear: oneDNN's fused linear + bias + activation (or + residual) against the torch reference
act(F.linear(x, w, b)), with transformers' own activations (ACT2FN) as the reference for what each config name means;
and the fallbacks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from kernels import linear as lin
from kernels.linear import Activation, fused_usable, linear, linear_add


def _inputs(shape: tuple[int, ...], n_out: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(n_out, shape[-1], generator=g) * shape[-1] ** -0.5
    b = torch.randn(n_out, generator=g)
    return x, w, b


class _Spy:
    """Counts calls to the fused op and passes them on."""

    def __init__(self, op) -> None:
        self.op, self.calls = op, 0

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


def _spy_on(monkeypatch, name: str, op: str) -> _Spy:
    assert getattr(lin, name) is not None, f"this torch (x86, oneDNN) has {op}"
    s = _Spy(getattr(lin, name))
    monkeypatch.setattr(lin, name, s)
    return s


@pytest.fixture
def spy(monkeypatch) -> _Spy:
    return _spy_on(monkeypatch, "_FUSED", "torch.ops.mkldnn._linear_pointwise")


@pytest.fixture
def binary_spy(monkeypatch) -> _Spy:
    return _spy_on(monkeypatch, "_FUSED_BINARY", "torch.ops.mkldnn._linear_pointwise.binary")


@pytest.mark.parametrize("act", list(Activation))
@pytest.mark.parametrize("shape,with_bias", [((300, 64), True), ((2, 7, 48), True), ((33, 64), False)])
def test_the_fused_op_equals_the_activation_of_f_linear(spy, act: Activation, shape, with_bias: bool) -> None:
    x, w, b = _inputs(shape, 96, seed=len(shape))
    b = b if with_bias else None
    with torch.inference_mode():
        got = linear(x, w, b, act)
    assert spy.calls == 1  # the oneDNN op ran, not the fallback
    want = act.reference(F.linear(x.double(), w.double(), None if b is None else b.double())).float()
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    if act is not Activation.NONE:  # the activation really is applied (not the bare GEMM)
        assert (got - linear(x, w, b, Activation.NONE)).abs().max().item() > 1e-2


def test_a_non_contiguous_input_gives_the_same_values(spy) -> None:
    x, w, b = _inputs((40, 128), 32)
    with torch.inference_mode():
        got = linear(x[:, ::2], w[:, :64].contiguous(), b, Activation.GELU)
    assert spy.calls == 1
    torch.testing.assert_close(got, F.gelu(F.linear(x[:, ::2], w[:, :64], b)), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "gelu_pytorch_tanh", "relu"])
def test_each_config_name_fuses_the_activation_transformers_means_by_it(spy, name: str) -> None:
    x, w, b = _inputs((64, 32), 48)
    with torch.inference_mode():
        got = linear(x, w, b, Activation.from_hf(name))
    torch.testing.assert_close(got, ACT2FN[name](F.linear(x, w, b)), atol=2e-5, rtol=1e-5)


def test_an_activation_it_cannot_fuse_is_left_to_the_caller() -> None:
    assert Activation.from_hf("silu") is None and Activation.from_hf("gelu") is Activation.GELU


def test_without_the_onednn_op_it_falls_back_to_the_reference(monkeypatch) -> None:
    monkeypatch.setattr(lin, "_FUSED", None)
    x, w, b = _inputs((50, 64), 80)
    assert not fused_usable(x, w)
    with torch.inference_mode():
        got = linear(x, w, b, Activation.GELU)
    assert torch.equal(got, F.gelu(F.linear(x, w, b)))


def test_with_onednn_disabled_or_torch_kernels_it_runs_the_reference(spy) -> None:
    x, w, b = _inputs((50, 64), 80)
    with torch.inference_mode():
        assert torch.equal(linear(x, w, b, Activation.RELU, mode="torch"), F.relu(F.linear(x, w, b)))
        with torch.backends.mkldnn.flags(enabled=False):
            assert torch.equal(linear(x, w, b, Activation.GELU), F.gelu(F.linear(x, w, b)))
        assert torch.equal(linear(x.double(), w.double(), b.double(), Activation.GELU),
                           F.gelu(F.linear(x.double(), w.double(), b.double())))  # float32 only
    assert spy.calls == 0


def test_a_call_that_needs_gradients_takes_the_differentiable_reference(spy) -> None:
    x, w, b = _inputs((20, 16), 8)
    w.requires_grad_(True)
    y = linear(x, w, b, Activation.GELU)
    assert spy.calls == 0 and y.grad_fn is not None
    y.sum().backward()
    assert w.grad is not None and w.grad.abs().sum().item() > 0


@pytest.mark.parametrize("x_slice", [False, True])
def test_linear_add_is_the_linear_plus_the_residual(binary_spy, x_slice: bool) -> None:
    x, w, b = _inputs((257, 128), 48, seed=3)
    x = x[:, ::2] if x_slice else x[:, :64].contiguous()
    residual = torch.randn(257, 48, generator=torch.Generator().manual_seed(9)) * 4
    with torch.inference_mode():
        got = linear_add(x, w[:, :64].contiguous(), b, residual)
    assert binary_spy.calls == 1
    want = (F.linear(x.double(), w[:, :64].double(), b.double()) + residual.double()).float()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert residual.abs().max().item() > 1 and (got - F.linear(x, w[:, :64], b)).abs().max().item() > 1  # added


def test_linear_add_falls_back_without_the_op_or_for_a_strided_residual(binary_spy, monkeypatch) -> None:
    x, w, b = _inputs((40, 32), 24)
    residual = torch.randn(24, 40).t()  # not contiguous
    with torch.inference_mode():
        assert torch.equal(linear_add(x, w, b, residual), F.linear(x, w, b) + residual)
        assert binary_spy.calls == 0
        monkeypatch.setattr(lin, "_FUSED_BINARY", None)
        assert torch.equal(linear_add(x, w, b, residual.contiguous()), F.linear(x, w, b) + residual)


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn-bf16", "reference-forced"])
@pytest.mark.parametrize("act", [Activation.NONE, Activation.GELU])
def test_bfloat16_is_the_float64_reference_to_bf16_rounding_on_either_path(spy, binary_spy, monkeypatch,
                                                                           act: Activation, onednn: bool) -> None:
    """The encoders' bf16 dtype (EngineConfig.encoder_dtype): oneDNN's fused bf16 op where it takes bf16 (an AVX-512
    CPU), the torch reference elsewhere (forced here on any CPU); either way the float64 result of the same bf16
    inputs to within bf16's rounding of the output (8 bits of mantissa: 2^-8 relative, 2^-7 with the sum's)."""
    if onednn and not lin._BF16_OK:
        pytest.skip("this CPU's oneDNN takes no bf16 (it needs AVX-512): the reference path is the forced case")
    monkeypatch.setattr(lin, "_BF16_OK", onednn)
    x, w, b = (t.to(torch.bfloat16) for t in _inputs((200, 384), 128, seed=3))
    residual = torch.randn(200, 128).to(torch.bfloat16)
    with torch.inference_mode():
        got = linear(x, w, b, act)
        added = linear_add(x, w, b, residual)
    assert (spy.calls, binary_spy.calls) == ((1, 1) if onednn else (0, 0))
    want = act.reference(F.linear(x.double(), w.double(), b.double()))
    assert got.dtype == torch.bfloat16 and added.dtype == torch.bfloat16
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= 2 ** -7 * scale
    want_added = F.linear(x.double(), w.double(), b.double()) + residual.double()
    assert (added.double() - want_added).abs().max().item() <= 2 ** -7 * want_added.abs().max().item()


def test_native_bf16_follows_the_cpus_flags() -> None:
    """Native bf16 is AVX512_BF16's dot products or AMX tiles, as the CPU reports them (torch's cpuinfo)."""
    flags = open("/proc/cpuinfo").read().split() if torch.backends.mkldnn.is_available() else []
    assert lin.native_bf16() == ("avx512_bf16" in flags or "amx_tile" in flags)
