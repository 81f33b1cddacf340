"""Modules that hold quantized weights (GGUF blocks as stored, or weight-only int8 of a dense model), and the
choice between them.

`EngineConfig.quantization` picks (see engine/config.py): "gguf" serves a GGUF file's tensors as they are stored
(engine/models/gguf_file.py reads them; engine/models/decoder_weights.py's `build_decoder` turns every block-format
matrix into a `QuantizedLinear` or the embedding table); "int8" quantizes every linear layer and the embedding of a dense
checkpoint per output channel. Activations stay float32; kernels/quant.py computes with the blocks, on the CPU path
(`quant.CpuPath`) each module was built with: the model's, resolved once by the engine's builder.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from kernels import quant
from kernels.quant import QuantWeight

log = logging.getLogger("tandem.engine")

_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")  # HF names


class QuantizedLinear(nn.Module):
    """y = x @ dequantize(W).T (+ bias), W kept quantized, multiplied on CPU path `path` (the model's; None:
    `quant.default_cpu_path()`). The blocks are buffers, so state_dict sees them."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None,
                 activations: quant.Activations = quant.Activations.FLOAT32,
                 path: quant.CpuPath | None = None) -> None:
        super().__init__()
        self.qweight = weight
        self.activations = activations
        self.path = path
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qdata", weight.data)
        self.register_buffer("qscales", weight.scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the decoder's [T, hidden]: no reshape and view back (two ops per matmul, 120 a step)
            y = quant.matmul(x, self.qweight, activations=self.activations, path=self.path)
            return y if self.bias is None else y + self.bias
        lead = x.shape[:-1]
        y = quant.matmul(x.reshape(-1, self.in_features), self.qweight, activations=self.activations, path=self.path)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def rows(self, ids: list[int]) -> torch.Tensor:
        """Dense float32 rows of the weight (e.g. the judge's two lm_head rows)."""
        return self.qweight.rows(torch.tensor(ids, dtype=torch.int64), None if self.path is None else self.path.isa)

    def extra_repr(self) -> str:
        path = "" if self.path is None else f", path={self.path.isa.label}"
        return (f"in={self.in_features}, out={self.out_features}, format={self.qweight.fmt}, "
                f"activations={self.activations.value}{path}")


class QuantizedEmbedding(nn.Module):
    """Embedding lookup that dequantizes only the rows it is asked for (on CPU path `path`, as QuantizedLinear)."""

    def __init__(self, weight: QuantWeight, path: quant.CpuPath | None = None) -> None:
        super().__init__()
        self.qweight = weight
        self.path = path
        self.register_buffer("qdata", weight.data)
        self.register_buffer("qscales", weight.scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.rows(ids, None if self.path is None else self.path.isa)


# ---- int8 ---------------------------------------------------------------------------------------------------


def quantize_state_int8(state: dict[str, torch.Tensor], tie_word_embeddings: bool) -> dict[
        str, torch.Tensor | QuantWeight]:
    """An HF-named state dict whose linear weights and embedding are per-channel int8 (the rest as given)."""
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for name, tensor in state.items():
        target = (name == "model.embed_tokens.weight" or name == "lm_head.weight"
                  or any(name.endswith(f"{p}.weight") for p in _LINEARS))
        if target and not (name == "lm_head.weight" and tie_word_embeddings):
            out[name] = quant.quantize_int8(tensor.float())
        else:
            out[name] = tensor
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights the model holds (parameters and quantized blocks; tied tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + [b for n, b in model.named_buffers() if n.endswith(("qdata", "qscales"))]:
        if t is None or t.is_meta or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def weight_format(model: nn.Module) -> str:
    """E.g. 'gguf Q4_1 + Q8_0 (float32 norms)', 'int8 per-channel', or the dense dtype."""
    formats = Counter(m.qweight.fmt for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding)))
    dense = {p.dtype for p in model.parameters()}
    dense_name = "/".join(sorted(str(d).removeprefix("torch.") for d in dense)) or "none"
    if not formats:
        return dense_name
    if set(formats) == {"I8"}:
        return f"int8 per-channel (+ {dense_name} norms)"
    return "gguf " + " + ".join(sorted(formats)) + f" (+ {dense_name} norms)"


def layer_formats(model: nn.Module) -> list[str]:
    """The formats of the quantized projections inside the model's layers (what a prefill chunk multiplies; the LM
    head takes one row per sequence), sorted."""
    layers = getattr(getattr(model, "model", model), "layers", model)
    return sorted({m.qweight.fmt for m in layers.modules() if isinstance(m, QuantizedLinear)})


def int8_activation_formats(model: nn.Module) -> list[str]:
    """The weight formats of the model's quantized linears that multiply int8 activations at small M under their
    setting (`quant.takes_int8`: every block format with "int8", the K-quants with "auto"), sorted."""
    return sorted({m.qweight.fmt for m in model.modules()
                   if isinstance(m, QuantizedLinear) and quant.takes_int8(m.activations, m.qweight.fmt)})


# ---- building the model -------------------------------------------------------------------------------------


def resolve_quantization(config, has_gguf: bool) -> str:
    """"gguf", "int8" or "none" for an EngineConfig whose model is (`has_gguf`) or is not a GGUF file: None means
    the file's blocks on CPU float32, dense otherwise. Without the C++ kernel a quantized choice falls back to dense
    float32 (logged)."""
    choice = config.quantization
    if choice == "gguf" and not has_gguf:
        raise ValueError(f"quantization='gguf' needs a GGUF file; {config.model!r} is a Hugging Face directory "
                         "(use 'int8' or 'none')")
    if choice is None:
        choice = "gguf" if (has_gguf and config.device == "cpu" and config.dtype == "float32") else "none"
    if choice != "none" and not quant.available():
        log.warning("quantization=%r needs the C++ quantized matmul kernel, which did not build here (see the "
                    "warning above): serving dense float32 weights instead", choice)
        return "none"
    return choice
