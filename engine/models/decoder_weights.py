"""The one decoder loader: Hugging Face-named tensors (dense, or GGUF blocks as `QuantWeight`;
engine/models/gguf_file.py renames a GGUF file's tensors to these names) put into a `DecoderForCausalLM`, fusing q/k/v and gate/up where the
parts share a format, with the ops, walker and attention backend its settings choose."""
from __future__ import annotations

import torch
from torch import nn

from kernels import quant
from kernels.quant import QuantWeight
from engine.models.decoder import ConcatLinear, DecoderForCausalLM, RopeTable
from engine.models.decoder_args import DecoderArgs, Family
from engine.models.decoder_ops import FusedOps, select_ops
from engine.models.decoder_walker import layer_walker, walker_rows
from engine.models.quantized import QuantizedEmbedding, QuantizedLinear
from engine.settings import Settings

Weight = torch.Tensor | QuantWeight

# our module -> the HF parameter names whose rows it concatenates
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_SINGLE = {"self_attn.o_proj": "self_attn.o_proj", "mlp.down_proj": "mlp.down_proj"}


def _norm_names(family: Family) -> dict[str, str]:
    """our norm -> its HF name inside a layer (Llama's post_attention_layernorm is the MLP's input norm)."""
    if family in (Family.GEMMA2, Family.GEMMA3):
        return {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
    return {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def make_linear(weights: list[Weight], biases: list[torch.Tensor] | None, dtype: torch.dtype,
                activations: quant.Activations = quant.Activations.FLOAT32,
                path: quant.CpuPath | None = None) -> nn.Module:
    """One module computing the concatenated outputs of these row blocks: rows fused into one matrix when the parts
    share a format (blocks concatenate as stored: rows are independent), else a ConcatLinear of the parts. Quantized
    parts multiply on CPU path `path`."""
    bias = torch.cat(biases).to(dtype) if biases else None
    if all(isinstance(w, QuantWeight) for w in weights) and len({w.fmt for w in weights}) == 1:
        first = weights[0]
        data = torch.cat([w.data for w in weights]) if len(weights) > 1 else first.data
        scales = (torch.cat([w.scales for w in weights]) if first.scales is not None and len(weights) > 1
                  else first.scales)
        qw = QuantWeight(data, first.fmt, (sum(w.shape[0] for w in weights), first.shape[1]), scales)
        return QuantizedLinear(qw, bias, activations, path)
    if all(isinstance(w, torch.Tensor) for w in weights):
        dense = torch.cat(weights).to(dtype) if len(weights) > 1 else weights[0].to(dtype)
        lin = nn.Linear(dense.shape[1], dense.shape[0], bias=bias is not None, device="meta")
        lin.weight = nn.Parameter(dense, requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias, requires_grad=False)
        return lin
    parts = [make_linear([w], None if biases is None else [b], dtype, activations, path) for w, b in
             zip(weights, biases or [None] * len(weights))]
    return ConcatLinear(parts)


def build_decoder(args: DecoderArgs, weights: dict[str, Weight], device: str = "cpu",
                  dtype: torch.dtype = torch.float32,
                  activations: quant.Activations = quant.Activations.FLOAT32,
                  settings: Settings | None = None, cpu_path: quant.CpuPath | None = None) -> DecoderForCausalLM:
    """The model holding these HF-named weights (rotary buffers and transformers' extras ignored); a missing or
    unexpected tensor is a ValueError naming it. `activations`: what quantized projections multiply with;
    `settings`: the kernel backend, fused ops and layer walker (None: the defaults); `cpu_path`: the CPU path the
    quantized weights multiply on (the builder resolves it from the settings; None: `quant.default_cpu_path()`),
    which the model holds (`DecoderForCausalLM.cpu_path`, None where no weight is quantized)."""
    settings = settings or Settings()
    quantized = any(isinstance(w, QuantWeight) for w in weights.values())
    cpu_path = (quant.default_cpu_path() if cpu_path is None else cpu_path) if quantized else None
    weights = {k: v for k, v in weights.items() if "rotary_emb" not in k}
    used: set[str] = set()
    missing: list[str] = []

    def take(name: str) -> Weight | None:
        if name not in weights:
            missing.append(name)
            return None
        used.add(name)
        return weights[name]

    def dense(name: str) -> torch.Tensor:
        w = take(name)
        if w is None:
            return torch.zeros(0)
        return (w.dequantize() if isinstance(w, QuantWeight) else w).to(dtype)

    def norm_weight(name: str) -> torch.Tensor:
        w = dense(name).float()
        return ((1.0 + w) if args.norm_offset else w).to(dtype)  # (1 + w) in fp32, as transformers computes it

    with torch.device("meta"):
        model = DecoderForCausalLM(args)
    embed = take("model.embed_tokens.weight")
    if isinstance(embed, QuantWeight):
        model.model.embed_tokens = QuantizedEmbedding(embed, cpu_path)
    elif embed is not None:
        model.model.embed_tokens = nn.Embedding.from_pretrained(embed.to(dtype), freeze=True)
    names = _norm_names(args.family)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        for ours, parts in _FUSED.items():
            ws = [take(p + part + ".weight") for part in parts]
            bias_names = [p + part + ".bias" for part in parts]
            biases = [dense(b) for b in bias_names] if ours.startswith("self_attn") and args.attention_bias else None
            if all(w is not None for w in ws):
                parent, attr = ours.split(".")
                setattr(getattr(layer, parent), attr, make_linear(ws, biases, dtype, activations, cpu_path))
        for ours, hf in _SINGLE.items():
            w = take(p + hf + ".weight")
            if w is not None:
                parent, attr = ours.split(".")
                setattr(getattr(layer, parent), attr, make_linear([w], None, dtype, activations, cpu_path))
        for ours, hf in names.items():
            getattr(layer, ours).weight = nn.Parameter(norm_weight(p + hf + ".weight"), requires_grad=False)
        if args.qk_norm:
            attn.q_norm.weight = nn.Parameter(norm_weight(p + "self_attn.q_norm.weight"), requires_grad=False)
            attn.k_norm.weight = nn.Parameter(norm_weight(p + "self_attn.k_norm.weight"), requires_grad=False)
    model.model.norm.weight = nn.Parameter(norm_weight("model.norm.weight"), requires_grad=False)
    if args.tie_word_embeddings:
        used.add("lm_head.weight")
        emb = model.model.embed_tokens
        model.lm_head = (QuantizedLinear(emb.qweight, None, activations, cpu_path)
                         if isinstance(emb, QuantizedEmbedding) else _linear_from(emb.weight))
    else:
        head = take("lm_head.weight")
        if head is not None:
            model.lm_head = make_linear([head], None, dtype, activations, cpu_path)
    unexpected = sorted(set(weights) - used)
    if missing or unexpected:
        raise ValueError(f"weights do not match the {args.family.value} model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.ropes = nn.ModuleList(RopeTable(s, args.max_position_embeddings) for s in args.ropes)
    model = model.to(device).eval()
    model.cpu_path = cpu_path
    ops = select_ops(device, dtype, settings.fused_ops)
    walker = layer_walker(model) if isinstance(ops, FusedOps) and settings.layer_walker else None
    return model.use_ops(ops, walker, settings.kernels, walker_rows(model) if walker is not None else 0)


def _linear_from(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    return lin
