"""Serving quantized weights: GGUF blocks as stored in the embedded file, or weight-only int8 of a dense model.

`EngineConfig.quantization` picks (see engine/config.py): "gguf" reads the embedded GGUF file's tensors as they
are stored; every Q4_0 / Q4_1 / Q8_0 matrix becomes a `QuantizedLinear` (or the embedding table), F32/F16 tensors
and any other block type stay dense float32 (logged). "int8" quantizes every linear layer and the embedding of a
dense checkpoint per output channel. Activations stay float32; kernels/quant.py computes with the blocks.
"""
from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from kernels import quant
from kernels.quant import QuantWeight

log = logging.getLogger("tandem.engine")

_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class QuantizedLinear(nn.Module):
    """y = x @ dequantize(W).T (+ bias), W kept quantized. The blocks are buffers, so state_dict sees them."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = weight
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qdata", weight.data)
        self.register_buffer("qscales", weight.scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = quant.matmul(x.reshape(-1, self.in_features), self.qweight)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def rows(self, ids: list[int]) -> torch.Tensor:
        """Dense float32 rows of the weight (e.g. the judge's two lm_head rows)."""
        return self.qweight.rows(torch.tensor(ids, dtype=torch.int64))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.qweight.fmt}"


class QuantizedEmbedding(nn.Module):
    """Embedding lookup that dequantizes only the rows it is asked for."""

    def __init__(self, weight: QuantWeight) -> None:
        super().__init__()
        self.qweight = weight
        self.register_buffer("qdata", weight.data)
        self.register_buffer("qscales", weight.scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.rows(ids)


# ---- GGUF ---------------------------------------------------------------------------------------------------

_GGUF_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]


def _hf_name(gguf_name: str) -> str:
    for pattern, repl in _GGUF_NAMES:
        if re.fullmatch(pattern, gguf_name):
            return re.sub(pattern, repl, gguf_name)
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' _reverse_permute_weights, on rows)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(n_rows)


def read_gguf(path: Path, num_heads: int, num_kv_heads: int) -> tuple[dict[str, torch.Tensor],
                                                                      dict[str, QuantWeight]]:
    """HF-named tensors of a Llama GGUF file: (dense float32 tensors, quantized weights as stored)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    dense: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantWeight] = {}
    kept_dense: Counter[str] = Counter()
    for t in reader.tensors:
        name = _hf_name(t.name)
        kind = t.tensor_type.name
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists ne0 (K) first
        data = torch.from_numpy(t.data.copy())
        rows = None
        if len(shape) == 2 and (".q_proj." in name or ".k_proj." in name):
            rows = _unpermute_rows(shape[0], num_heads if ".q_proj." in name else num_kv_heads)
        if kind in quant.BLOCK_BYTES and len(shape) == 2:
            data = data.view(torch.uint8).reshape(shape[0], -1)
            quantized[name] = QuantWeight(data if rows is None else data[rows], kind, shape)
            continue
        if kind in ("F32", "F16", "BF16"):
            tensor = data.float().reshape(shape) if kind != "BF16" else data.view(torch.bfloat16).float().reshape(shape)
        else:  # a block type the kernels do not cover: dequantize it with GGUF's own code, serve it dense
            kept_dense[kind] += 1
            tensor = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(shape)
        dense[name] = tensor if rows is None else tensor[rows]
    for kind, count in kept_dense.items():
        log.warning("%d GGUF tensors of type %s have no quantized kernel: served as dense float32", count, kind)
    return dense, quantized


_CACHE_VERSION = "v1"


def load_gguf(path: Path, num_heads: int, num_kv_heads: int) -> tuple[dict[str, torch.Tensor],
                                                                      dict[str, QuantWeight]]:
    """read_gguf through a cache: the first start writes the tensors (blocks as stored, q/k rows already in HF
    order) to a safetensors file under TANDEM_CACHE_DIR; later starts load it in a fraction of a second (GGUFReader
    parses the whole tokenizer vocabulary in Python, seconds on a small CPU)."""
    import json
    import os

    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.models.loader import cache_root

    stat = path.stat()
    target = cache_root() / f"{path.stem}.blocks-{_CACHE_VERSION}-{stat.st_size}.safetensors"
    if target.is_file():
        with safe_open(str(target), framework="pt") as f:
            formats = json.loads(f.metadata()["formats"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        quantized = {k: QuantWeight(tensors.pop(k), fmt, (n, kk)) for k, (fmt, n, kk) in formats.items()}
        return tensors, quantized
    dense, quantized = read_gguf(path, num_heads, num_kv_heads)
    formats = {k: [w.fmt, *w.shape] for k, w in quantized.items()}
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    save_file({**dense, **{k: w.data for k, w in quantized.items()}}, str(tmp),
              metadata={"format": "pt", "formats": json.dumps(formats)})
    os.replace(tmp, target)
    return dense, quantized


def _fuse(quantized: dict[str, QuantWeight], dense: dict[str, torch.Tensor]) -> None:
    """Concatenate q/k/v and gate/up rows into the model's fused projections (rows are independent, so blocks
    concatenate as they are); parts in different formats are dequantized and fused dense."""
    fusions = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    layers = {k.split(".self_attn.")[0].split(".mlp.")[0] for k in list(quantized) + list(dense) if ".layers." in k}
    for layer in layers:
        for fused, parts in fusions.items():
            names = [f"{layer}.{p}.weight" for p in parts]
            if all(n in quantized for n in names) and len({quantized[n].fmt for n in names}) == 1:
                ws = [quantized.pop(n) for n in names]
                data = torch.cat([w.data for w in ws], dim=0)
                quantized[f"{layer}.{fused}.weight"] = QuantWeight(
                    data, ws[0].fmt, (sum(w.shape[0] for w in ws), ws[0].shape[1]))
            elif any(n in quantized for n in names):
                log.warning("%s.%s: parts in different formats, served dense", layer, fused)
                for n in names:
                    if n in quantized:
                        dense[n] = quantized.pop(n).dequantize()
            # dense parts (and biases) are fused by LlamaForCausalLM.load_hf_state_dict


# ---- int8 ---------------------------------------------------------------------------------------------------


def quantize_state_int8(state: dict[str, torch.Tensor], tie_word_embeddings: bool) -> tuple[
        dict[str, torch.Tensor], dict[str, QuantWeight]]:
    """Split a fused HF-named state dict: linear weights and the embedding become per-channel int8."""
    dense, quantized = {}, {}
    for name, tensor in state.items():
        target = (name == "model.embed_tokens.weight" or name == "lm_head.weight"
                  or any(name.endswith(f"{p}.weight") for p in _LINEARS))
        if target and not (name == "lm_head.weight" and tie_word_embeddings):
            quantized[name] = quant.quantize_int8(tensor)
        else:
            dense[name] = tensor
    return dense, quantized


# ---- putting quantized weights into a model -----------------------------------------------------------------


def install(model: nn.Module, quantized: dict[str, QuantWeight]) -> None:
    """Replace the nn.Linear / nn.Embedding modules named by `quantized` (HF names, fused) with quantized ones.
    A tied lm_head shares the embedding's blocks."""
    for name, weight in quantized.items():
        module_name = name.rsplit(".", 1)[0]
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if isinstance(old, nn.Embedding):
            setattr(parent, attr, QuantizedEmbedding(weight))
        else:
            setattr(parent, attr, QuantizedLinear(weight, getattr(old, "bias", None)))  # a meta bias loads later
    if model.args.tie_word_embeddings and isinstance(model.model.embed_tokens, QuantizedEmbedding):
        model.lm_head = QuantizedLinear(model.model.embed_tokens.qweight)


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


# ---- building the model -------------------------------------------------------------------------------------


def resolve_quantization(config) -> str:
    """"gguf", "int8" or "none" for an EngineConfig: None means the embedded model's GGUF blocks on CPU float32,
    dense otherwise. Without the C++ kernel a quantized choice falls back to dense float32 (logged)."""
    choice = config.quantization
    if choice is None:
        choice = "gguf" if (config.model is None and config.device == "cpu" and config.dtype == "float32") else "none"
    if choice != "none" and not quant.available():
        log.warning("quantization=%r needs the C++ quantized matmul kernel, which did not build here (see the "
                    "warning above): serving dense float32 weights instead", choice)
        return "none"
    return choice


def build_quantized_model(args, model_dir: Path, quantization: str):
    """A LlamaForCausalLM whose linear layers and embedding hold quantized weights ("gguf": the embedded file's
    blocks; "int8": the directory's dense weights quantized per output channel)."""
    from engine.models.llama import LlamaForCausalLM, Rotary, _fuse_projections
    from engine.models.loader import embedded_gguf_path, load_state_dict

    if quantization == "gguf":
        dense, quantized = load_gguf(embedded_gguf_path(), args.num_heads, args.num_kv_heads)
        _fuse(quantized, dense)
        dense = _fuse_projections(dense)
    elif quantization == "int8":
        state = {k: v.float() for k, v in _fuse_projections(load_state_dict(model_dir)).items()}
        dense, quantized = quantize_state_int8(state, args.tie_word_embeddings)
    else:
        raise ValueError(f"not a quantized format: {quantization!r}")
    dense = {k: v.float() for k, v in dense.items() if "rotary_emb" not in k}
    if args.tie_word_embeddings:
        dense.pop("lm_head.weight", None)
        quantized.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    install(model, quantized)
    if args.tie_word_embeddings and not isinstance(model.model.embed_tokens, QuantizedEmbedding):
        raise ValueError("tied embeddings: the embedding must be quantized when the LM head is")
    missing, unexpected = model.load_state_dict(dense, strict=False, assign=True)
    missing = [m for m in missing if not m.endswith(("qdata", "qscales")) and not
               (m == "lm_head.weight" and args.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.rotary = Rotary(args.head_dim, args.rope_theta, args.max_position_embeddings)
    return model.eval()
