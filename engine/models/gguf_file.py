"""A GGUF file as a model: its metadata as a Hugging Face config + tokenizer (read by transformers' GGUF support,
cached), its tensors renamed to Hugging Face names and kept in their blocks as stored (kernels/quant.py formats).

A tensor of a type no kernel covers is refused at start-up, naming the tensor and its type. Both the metadata and
the tensors are cached under TANDEM_CACHE_DIR on first use: gguf-py and transformers parse the whole tokenizer
vocabulary in Python (tens of seconds for a 262k vocabulary on a small CPU), a later start reads the cache.
"""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import torch

from kernels import quant
from kernels.quant import QuantWeight
from engine.models.cache_write import write_atomically
from engine.models.decoder_args import ARCHITECTURES, architecture

log = logging.getLogger("tandem.engine")

GGUF_MAGIC = b"GGUF"
DENSE_TYPES = ("F32",)
SUPPORTED_TYPES = (*quant.BLOCK_BYTES, *DENSE_TYPES)
_CACHE_VERSION = "v2"

_COMMON = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
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
_LLAMA_NORMS = [(r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight")]
_GEMMA_NORMS = [
    (r"blk\.(\d+)\.post_attention_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.pre_feedforward_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", r"model.layers.\1.post_feedforward_layernorm.weight"),
]


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def hf_name(gguf_name: str, arch: str) -> str:
    table = _COMMON + (_GEMMA_NORMS if arch.startswith("gemma") else _LLAMA_NORMS)
    for pattern, repl in table:
        if re.fullmatch(pattern, gguf_name):
            return re.sub(pattern, repl, gguf_name)
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in a {arch} model")


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' _reverse_permute_weights, on rows)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(n_rows)


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_gguf(path: Path) -> tuple[str, dict[str, torch.Tensor | QuantWeight]]:
    """(architecture, HF-named tensors): dense float32 tensors and quantized weights as stored. llama.cpp's
    conventions are undone as transformers undoes them: Llama's q/k row permutation, Gemma's norms stored as 1 + w."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = check_file(path, reader)
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv") or heads)
    tensors: dict[str, torch.Tensor | QuantWeight] = {}
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        kind = t.tensor_type.name
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists ne0 (K) first
        data = torch.from_numpy(t.data.copy())
        rows = None
        if arch in ("llama", "mistral") and len(shape) == 2 and (".q_proj." in name or ".k_proj." in name):
            rows = _unpermute_rows(shape[0], heads if ".q_proj." in name else kv_heads)
        if kind in quant.BLOCK_BYTES and len(shape) == 2:
            data = data.view(torch.uint8).reshape(shape[0], -1)
            tensors[name] = QuantWeight(data if rows is None else data[rows], kind, shape)
            continue
        if kind in quant.BLOCK_BYTES:  # a 1-d tensor in blocks (a norm): dequantized, as transformers does
            dense = QuantWeight(data.view(torch.uint8).reshape(1, -1), kind, (1, shape[0])).dequantize()[0]
        else:
            dense = data.float()
        dense = dense.reshape(shape)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            dense = dense - 1  # llama.cpp stores Gemma's (1 + w); transformers subtracts the 1 again
        tensors[name] = dense if rows is None else dense[rows]
    return arch, tensors


def check_file(path: Path, reader) -> str:
    """The file's architecture, once it is known that tandem serves it and every tensor's type; else a ValueError
    that names the architecture, or the first tensor of an unsupported type and that type."""
    arch = str(_field(reader, "general.architecture"))
    served = [a.gguf for a in ARCHITECTURES]
    if arch not in served:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(served)}")
    unsupported = [(t.name, t.tensor_type.name) for t in reader.tensors if t.tensor_type.name not in SUPPORTED_TYPES]
    if unsupported:
        name, kind = unsupported[0]
        raise ValueError(f"{path}: tensor {name!r} is stored as {kind}, which tandem cannot serve "
                         f"({len(unsupported)} such tensors; supported types: {', '.join(SUPPORTED_TYPES)})")
    return arch


def load_gguf(path: Path, cache: Path) -> dict[str, torch.Tensor | QuantWeight]:
    """read_gguf through a cache: the first start writes the tensors (blocks as stored, in HF names and order) to a
    safetensors file under TANDEM_CACHE_DIR; later starts load it in a fraction of a second."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    target = cache / f"{path.stem}.blocks-{_CACHE_VERSION}-{path.stat().st_size}.safetensors"
    if target.is_file():
        with safe_open(str(target), framework="pt") as f:
            formats = json.loads(f.metadata()["formats"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        for k, (fmt, n, kk) in formats.items():
            tensors[k] = QuantWeight(tensors[k], fmt, (n, kk))
        return tensors
    started = time.monotonic()
    log.info("converting %s (%.0f MB) into %s: once per file", path.name, path.stat().st_size / 1e6, target)
    _, tensors = read_gguf(path)
    formats = {k: [w.fmt, *w.shape] for k, w in tensors.items() if isinstance(w, QuantWeight)}
    stored = {k: (w.data if isinstance(w, QuantWeight) else w.contiguous()) for k, w in tensors.items()}
    write_atomically(target, lambda tmp: save_file(stored, str(tmp), metadata={"format": "pt",
                                                                              "formats": json.dumps(formats)}))
    log.info("converted %s in %.1f s", path.name, time.monotonic() - started)
    return tensors


def metadata_dir(path: Path, cache: Path) -> Path:
    """A directory holding the file's config.json (with `architectures`) and tokenizer, as transformers reads them
    from the GGUF metadata; written once under `cache`."""
    target = cache / f"{path.stem}.meta-{_CACHE_VERSION}-{path.stat().st_size}"
    if (target / "config.json").is_file():
        return target
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    started = time.monotonic()
    log.info("reading the config and tokenizer of %s (%.0f MB) into %s: once per file", path.name,
             path.stat().st_size / 1e6, target)
    check_file(path, gguf.GGUFReader(str(path)))
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [architecture({"model_type": config["model_type"]}).name]
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

    def write(tmp: Path) -> None:
        tmp.mkdir(exist_ok=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))

    written = write_atomically(target, write)
    log.info("read the config and tokenizer of %s in %.1f s", path.name, time.monotonic() - started)
    return written
