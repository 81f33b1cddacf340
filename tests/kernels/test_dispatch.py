"""The dispatcher routes each op per its mode, TANDEM_KERNELS read once at start-up (torch | triton | cpp | auto =
Triton on CUDA tensors, the C++ decode kernel for CPU paged attention, the torch reference for the other CPU ops)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kernels
from kernels import cpu_decode, dispatch, reference, triton_kv_cache, triton_paged_attention, triton_varlen_attention
from tests.kernels.batches import paged_batch, varlen_batch

_OPS = [
    ("paged_attention", triton_paged_attention),
    ("varlen_attention", triton_varlen_attention),
    ("write_kv_cache", triton_kv_cache),
]


def _inputs(op: str) -> tuple:
    if op == "varlen_attention":
        q, k, v, cu = varlen_batch([3, 5], num_heads=2, head_dim=16)
        return q, k, v, cu, 0.25
    batch = paged_batch([(4, 2), (9, 1)], block_size=16, num_kv_heads=1, group=1, head_dim=16)
    if op == "paged_attention":
        return batch.args()
    key = torch.randn(2, 1, 16)
    return key, key, batch.k_cache, batch.v_cache, torch.tensor([0, -1])


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace both implementations of every op with recorders that still run the real op."""
    seen: list[str] = []

    def spy(label: str, fn):
        def wrapper(*args):
            seen.append(label)
            return fn(*args)
        return wrapper

    for op, module in _OPS:
        monkeypatch.setattr(reference, op, spy(f"torch:{op}", getattr(reference, op)))
        monkeypatch.setattr(module, op, spy(f"triton:{op}", getattr(module, op)))
    monkeypatch.setattr(cpu_decode, "paged_attention", spy("cpp:paged_attention", cpu_decode.paged_attention))
    return seen


_CPP = ["cpp:paged_attention", "torch:varlen_attention", "torch:write_kv_cache"]


@pytest.mark.parametrize("mode,expected", [
    ("torch", [f"torch:{op}" for op, _ in _OPS]),
    ("triton", [f"triton:{op}" for op, _ in _OPS]),
    ("cpp", _CPP), ("auto", _CPP), (None, _CPP),
])
def test_mode_picks_the_implementation_on_cpu(mode: str | None, expected: list[str], calls: list[str]) -> None:
    for op, _ in _OPS:
        getattr(kernels, op)(*_inputs(op), **({} if mode is None else {"mode": mode}))
    assert calls == expected


def test_cpp_falls_back_to_the_reference_for_other_dtypes_unless_forced(calls: list[str]) -> None:
    batch = paged_batch([(4, 1), (9, 1)], block_size=16, num_kv_heads=1, group=1, head_dim=16, dtype=torch.float64)
    kernels.paged_attention(*batch.args(), mode="auto")
    assert calls == ["torch:paged_attention"]
    with pytest.raises(RuntimeError, match="float32"):
        kernels.paged_attention(*batch.args(), mode="cpp")


def test_auto_picks_triton_for_cuda_tensors() -> None:
    assert dispatch.backend(SimpleNamespace(is_cuda=True), "auto") == "triton"
    assert dispatch.backend(SimpleNamespace(is_cuda=False), "auto") == "cpp"
    assert dispatch.backend(SimpleNamespace(is_cuda=True), "torch") == "torch"


def test_unknown_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="TANDEM_KERNELS"):
        kernels.paged_attention(*_inputs("paged_attention"), mode="cuda")


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="CUDA"):
        dispatch.backend(torch.zeros(1), "triton")


@pytest.mark.parametrize("window,softcap", [(16, 0.0), (0, 30.0)])
def test_triton_refuses_a_window_or_softcap_rather_than_ignore_it(monkeypatch: pytest.MonkeyPatch, window: int,
                                                                  softcap: float) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    batch = paged_batch([(0, 1), (20, 1)], 16, num_kv_heads=1, group=2, head_dim=16)
    with pytest.raises(NotImplementedError, match="no sliding window or soft-cap"):
        dispatch.paged_attention(*batch.args(), window=window, softcap=softcap, mode="triton")
    # the reference takes both
    assert dispatch.paged_attention(*batch.args(), window=window, softcap=softcap,
                                    mode="torch").shape == batch.query.shape
