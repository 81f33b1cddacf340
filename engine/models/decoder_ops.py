"""The small ops of a decoder layer (norms, activation, RoPE), chosen once per backend at build (`select_ops`): plain
torch on any device and dtype, or the fused C++ CPU ops of kernels/quant.py for float32 on CPU."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import quant
from engine.models.decoder_args import Activation


class TorchOps:
    """The small ops of a layer in plain torch (any device and dtype)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op instead of five: matters for small decode batches
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        x32 = x.float()  # half precision: normalise in fp32 first, as transformers does
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += x (in place), then RMSNorm(residual) * weight."""
        if x is not None:
            residual.add_(x)
        return self.rms_norm(residual, weight, eps)

    @staticmethod
    def act_mul(gate_up: torch.Tensor, activation: Activation) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if activation is Activation.SILU:
            return F.silu(gate) * up
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def rotary_(qkv: torch.Tensor, n: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate-half RoPE of the first n heads of qkv [T, H, D] in place; cos/sin [T, D]."""
        x = qkv[:, :n]
        half = x.shape[-1] // 2
        c, s = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        qkv[:, :n] = x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


# Steps wider than this many rows take torch's silu in FusedOps.act_mul (narrow ones, and every step the layer walker
# takes, the C++ silu_mul): above the widest narrow kernel (kernels/quant.py _SMALL_M) with room to spare.
WIDE_SILU_ROWS = 64


class FusedOps(TorchOps):
    """CPU float32: residual add + RMSNorm, SiLU * up and RoPE each one C++ call (kernels/quant.py)."""

    def __init__(self, module) -> None:
        self.m = module

    def add_rms_norm(self, x, residual, weight, eps):
        return self.m.add_rms_norm(x, residual, weight, eps)

    def rms_norm(self, x, weight, eps):
        """One C++ call (Gemma's q/k and post norms: torch's rms_norm was ~20 ops each, 72 of them a step)."""
        rows = x.reshape(-1, x.shape[-1])  # a copy for the strided q/k heads of qkv, a view otherwise
        return self.m.add_rms_norm(None, rows if rows.is_contiguous() else rows.contiguous(), weight,
                                   eps).view(x.shape)

    def act_mul(self, gate_up, activation):
        """SiLU(gate) * up in one C++ call for narrow steps; a wide step (prefill chunks) takes torch's vectorised
        silu and an in-place multiply (the C++ loop's scalar expf was 2.3x their time at 512 rows, ~5% of a 512-token
        prefill; kernels/README.md "Prefill on CPU"), transformers' own arithmetic."""
        if activation is not Activation.SILU:
            return TorchOps.act_mul(gate_up, activation)
        if gate_up.shape[0] > WIDE_SILU_ROWS:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate).mul_(up)
        return self.m.silu_mul(gate_up)

    def rotary_(self, qkv, n, cos, sin):
        self.m.rotary_(qkv, n, cos, sin)


def select_ops(device: torch.device | str, dtype: torch.dtype, fused: bool = True) -> TorchOps:
    """FusedOps for float32 on CPU when the C++ module built (`fused` False: TANDEM_FUSED_OPS=0 turns them off),
    else TorchOps."""
    if torch.device(device).type == "cpu" and dtype == torch.float32 and fused and quant.available():
        return FusedOps(quant._module())
    return TorchOps()
