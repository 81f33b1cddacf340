"""A linear layer with its bias and activation in one call: on float32 (and bfloat16) CPU, oneDNN's fused inner
product (`torch.ops.mkldnn._linear_pointwise`, what inductor's CPU fusion calls), elsewhere the torch reference
`act(F.linear(x, w, b))`.

Why: `F.linear` on CPU is `addmm`, which first copies the bias into every row of the output and then runs MKL's GEMM
over it, and an activation after it is one more pass over the output. On an encoder step of 4,000 rows (MiniLM,
384 -> 1536) the bias copy and the separate GELU pass were a quarter of the up projection's time; oneDNN adds the
bias and applies the activation while the GEMM's output tile is still in cache. The values agree with the reference
to float32 rounding (tests/kernels/test_linear.py); in bfloat16 (the encoders' dtype on CPUs with native bf16, engine
EngineConfig.encoder_dtype) to bf16 rounding, and the fused bf16 GEMM + GELU ran 1.7x faster than `F.linear` + GELU in
bf16 on a Zen 4 core.
"""
from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from kernels.dispatch import backend


class Activation(enum.Enum):
    """An activation the fused path applies inside the GEMM, by the oneDNN post-op (name, algorithm) that does it."""
    NONE = ("none", "")
    GELU = ("gelu", "none")  # exact (erf) GELU: transformers' "gelu"
    GELU_TANH = ("gelu", "tanh")  # tanh approximation: transformers' "gelu_new" / "gelu_pytorch_tanh"
    RELU = ("relu", "")

    @classmethod
    def from_hf(cls, name: str) -> "Activation | None":
        """The activation a transformers config's `hidden_act` names, or None when the fused path has none for it."""
        return _HF_NAMES.get(name)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        if self is Activation.GELU:
            return F.gelu(x)
        if self is Activation.GELU_TANH:
            return F.gelu(x, approximate="tanh")
        if self is Activation.RELU:
            return F.relu(x)
        return x


_HF_NAMES = {"gelu": Activation.GELU, "gelu_new": Activation.GELU_TANH, "gelu_pytorch_tanh": Activation.GELU_TANH,
             "relu": Activation.RELU}


def _find_fused_op(overload: str):
    """An overload of oneDNN's fused linear, or None where this torch has no oneDNN (or no such op)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return getattr(torch.ops.mkldnn._linear_pointwise, overload)
    except (AttributeError, RuntimeError):
        return None


_FUSED = _find_fused_op("default")  # (x, w, b, activation, scalars, algorithm)
_FUSED_BINARY = _find_fused_op("binary")  # (x, other, w, b, "add"): the GEMM's output plus `other`, in its epilogue


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512_BF16's dot products or AMX tiles), where oneDNN's bf16
    GEMM ran ~2.8x its float32 rate on a Zen 4; elsewhere bf16 is converted to float32 around the same FMA units."""
    return bool(torch.backends.mkldnn.is_available()
                and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))


# oneDNN takes bf16 where the CPU has AVX-512 (natively with AVX512_BF16 / AMX, converted otherwise); below that the
# op refuses bf16, so the reference runs.
_BF16_OK = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def fused_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear`'s oneDNN path takes this call: the op is there, float32 CPU tensors (or bfloat16 where
    oneDNN takes them), oneDNN enabled, and no gradient to track (the op has no backward)."""
    return _FUSED is not None and _onednn_takes(x, weight)


def _onednn_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (torch.backends.mkldnn.enabled and x.device.type == "cpu" and x.dtype == weight.dtype
            and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and _BF16_OK))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: Activation = Activation.NONE,
           mode: str = "auto") -> torch.Tensor:
    """act(x @ weight.T + bias) over the last dimension of x. `mode` (TANDEM_KERNELS): "torch" always runs the
    reference; the others take oneDNN's fused op where `fused_usable`."""
    if backend(x, mode) != "torch" and fused_usable(x, weight):
        name, algorithm = act.value
        return _FUSED(x, weight, bias, name, [], algorithm)
    return act.reference(F.linear(x, weight, bias))


def linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
               mode: str = "auto") -> torch.Tensor:
    """x @ weight.T + bias + residual (a post-LN layer's projection and its residual, before the norm), the sum in
    the GEMM's epilogue on the oneDNN path; the reference adds in place into the linear's own output."""
    if (backend(x, mode) != "torch" and _FUSED_BINARY is not None and _onednn_takes(x, weight)
            and residual.dtype == x.dtype and residual.is_contiguous()
            and not (torch.is_grad_enabled() and residual.requires_grad)):
        return _FUSED_BINARY(x, residual, weight, bias, "add")
    return F.linear(x, weight, bias).add_(residual)


__all__ = ["Activation", "fused_usable", "linear", "linear_add", "native_bf16"]
