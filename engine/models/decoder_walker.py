"""The C++ walker of a decoder's layers (kernels/quant.py `decode_layers`): every layer of a decode-only step of up to
`walker_rows` rows in one call, built once from the loaded model's blocks and norms."""
from __future__ import annotations

import sys

import torch
from torch import nn

from kernels import quant
from engine.models.decoder import ConcatLinear, DecoderForCausalLM
from engine.models.decoder_args import Activation
from engine.models.quantized import QuantizedLinear


def layer_walker(model: DecoderForCausalLM):
    """The C++ walker of this model's layers (kernels/quant.py `decode_layers`), or None where it does not apply:
    the C++ modules not built, or a projection that is not blocks in a C++ format (dense weights, F16 / BF16
    tensors). Projections with `--cpu-activations int8` multiply int8-rounded rows where the format and path have an
    int8 kernel, exactly as QuantizedLinear does. TANDEM_LAYER_WALKER=0 (A/B runs) keeps build_decoder from asking."""
    a = model.args
    walker = quant.decode_layers(a.num_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps,
                                 a.activation is Activation.GELU_TANH)
    if walker is None:
        return None
    layers = model.model.layers
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        projections = [_walker_projection(m) for m in _projections(layer)]
        if any(p is None for p in projections):
            return None
        weight = lambda norm: None if norm is None else norm.weight  # noqa: E731
        next_norm = layers[i + 1].attn_norm if i + 1 < len(layers) else model.model.norm
        walker.add_layer(*projections, weight(attn.q_norm), weight(attn.k_norm), weight(layer.attn_post_norm),
                         layer.mlp_norm.weight, weight(layer.mlp_post_norm), next_norm.weight, attn.scale,
                         attn.window, attn.softcap, attn.rope)
    return walker


def narrow_rows(model: DecoderForCausalLM) -> int | None:
    """The widest step whose projections all stay on their narrow (in-register) kernels: the least width
    (`quant.register_rows`) of every quantized projection part's kernel on the model's CPU path (`cpu_path`); None
    where no step leaves it (dense weights, or every part's kernel takes every width: the K-quants' int8 kernel on a
    CPU without AVX-512). The one owner of that width: the walker takes decode steps up to it, and the step-time
    model prices a step past it as the costlier wide path (engine/builder.py hands it to the admission policy and
    calibration)."""
    widths = [quant.register_rows(p.qweight.fmt, p.activations, model.cpu_path) for layer in model.model.layers
              for m in _projections(layer) for p in _parts(m) if isinstance(p, QuantizedLinear)]
    bounded = [w for w in widths if w is not None]
    return min(bounded) if bounded else None


def walker_rows(model: DecoderForCausalLM) -> int:
    """The widest decode step the walker takes: the model's `narrow_rows`, so the walker and the layer loop multiply a
    step with the same kernels (bit for bit); `sys.maxsize` where every part's kernel takes every width."""
    rows = narrow_rows(model)
    return sys.maxsize if rows is None else rows


def _projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A layer's four projections, in the order the walker takes them."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _parts(module: nn.Module) -> list[nn.Module]:
    """A projection's parts: those of a ConcatLinear, else the projection itself."""
    return list(module.parts) if isinstance(module, ConcatLinear) else [module]


def _walker_projection(module: nn.Module):
    """A walker projection of a QuantizedLinear or a ConcatLinear of them (C++ formats, one kind of activations)."""
    parts = _parts(module)
    if not all(isinstance(p, QuantizedLinear) and p.qweight.fmt in quant.CPP_FORMATS for p in parts):
        return None
    if len({p.activations for p in parts}) != 1:
        return None
    biases = [p.bias for p in parts]
    bias = None
    if any(b is not None for b in biases):  # a part without one adds zeros
        bias = torch.cat([b.detach() if b is not None else torch.zeros(p.out_features)
                          for b, p in zip(biases, parts)]).float().contiguous()
    return quant.projection([p.qweight for p in parts], bias, parts[0].activations)
