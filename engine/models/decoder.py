"""The one decoder definition (Llama, SmolLM, Mistral, Qwen2/3, Gemma 2/3) over a flat ragged batch with a paged
KV cache.

The layer is written once (`DecoderForCausalLM.forward`); what differs between families is data in `DecoderArgs`
(norm placement, (1 + w) norms, activation, q/k norms, sliding windows, rope bases, soft-caps), and what differs
between backends is an `Ops` object chosen once at build (`select_ops`): the fused C++ CPU ops of kernels/quant.py
or plain torch. `build_decoder` is the one loader: it takes Hugging Face-named tensors (dense, or GGUF blocks as
`QuantWeight`; engine/models/gguf_file.py renames a GGUF file's tensors to these names) and puts them into the model,
fusing q/k/v and gate/up where the parts share a format.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import nn
import torch.nn.functional as F

import kernels
from kernels import quant
from kernels.quant import QuantWeight
from engine.attention import AttentionMetadata
from engine.models.quantized import QuantizedEmbedding, QuantizedLinear
from engine.settings import Settings


class Family(Enum):
    LLAMA = "llama"  # Llama, SmolLM, Mistral
    QWEN2 = "qwen2"  # q/k/v biases
    QWEN3 = "qwen3"  # q/k norms
    GEMMA2 = "gemma2"  # sandwich norms, (1 + w), GeGLU, scaled embeddings, soft-caps, sliding windows
    GEMMA3 = "gemma3"  # Gemma 2 without soft-caps, with q/k norms and a second rope base for sliding layers


ARCHITECTURES = {
    "LlamaForCausalLM": Family.LLAMA, "MistralForCausalLM": Family.LLAMA, "Qwen2ForCausalLM": Family.QWEN2,
    "Qwen3ForCausalLM": Family.QWEN3, "Gemma2ForCausalLM": Family.GEMMA2, "Gemma3ForCausalLM": Family.GEMMA3,
}
# model_type -> architecture, for configs without `architectures` (a GGUF file's, read by transformers)
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
               "gemma3": "Gemma3ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class Activation(Enum):
    SILU = "silu"
    GELU_TANH = "gelu_pytorch_tanh"


@dataclass(slots=True)
class RopeSpec:
    """Inverse frequencies of one rope base (and scaling) and the factor transformers multiplies cos/sin by."""
    inv_freq: torch.Tensor
    attention_scaling: float = 1.0


@dataclass(slots=True)
class DecoderArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3, Gemma 3 normalise q and k per head
    family: Family = Family.LLAMA
    activation: Activation = Activation.SILU
    norm_offset: bool = False  # Gemma: RMSNorm scales by (1 + w)
    sandwich_norms: bool = False  # Gemma: norms after attention and after the MLP too
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden)
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float = 0.0  # Gemma 2: tanh soft-cap of attention scores (0: none)
    final_softcap: float = 0.0  # Gemma 2: tanh soft-cap of the logits (0: none)
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 = global; () = all global
    # per layer: which rope table it uses (an index into `ropes`); () = all use ropes[0]
    layer_ropes: tuple[int, ...] = ()
    ropes: list[RopeSpec] = field(default_factory=list)  # () = one default table from rope_theta

    def __post_init__(self) -> None:
        if not self.ropes:
            self.ropes = [RopeSpec(default_inv_freq(self.rope_theta, self.head_dim))]
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError("layer_windows needs one entry per layer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not divide into {self.num_kv_heads} KV heads")

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def rope_index(self, layer: int) -> int:
        return self.layer_ropes[layer] if self.layer_ropes else 0

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "DecoderArgs":
        arch = (cfg.get("architectures") or [MODEL_TYPES.get(cfg.get("model_type", "llama"), "?")])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r} (model_type {cfg.get('model_type')!r}); "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        family = ARCHITECTURES[arch]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        gemma = family in (Family.GEMMA2, Family.GEMMA3)
        n_layers = cfg["num_hidden_layers"]
        layer_types = _layer_types(cfg, family, n_layers)
        window = cfg.get("sliding_window") or 0
        if family is Family.LLAMA and arch == "MistralForCausalLM" and window and window < cfg.get(
                "max_position_embeddings", 0):
            layer_types = ["sliding_attention"] * n_layers
        windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types) if window else ()
        ropes, layer_ropes = _rope_tables(cfg, head_dim, layer_types)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported activation {act!r}")
        scalar = cfg.get("query_pre_attn_scalar") if gemma else None
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=n_layers, num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_base_theta(cfg), max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
            attention_bias=bool(cfg.get("attention_bias", family is Family.QWEN2)),
            qk_norm=family in (Family.QWEN3, Family.GEMMA3), family=family, activation=Activation(act),
            norm_offset=gemma, sandwich_norms=gemma, embed_scale=gemma,
            attn_scale=None if scalar is None else scalar ** -0.5,
            attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0) if gemma else 0.0,
            final_softcap=float(cfg.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
            layer_windows=windows, layer_ropes=layer_ropes, ropes=ropes)


def default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _layer_types(cfg: dict, family: Family, n_layers: int) -> list[str]:
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if family is Family.GEMMA2:  # even layers slide
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    if family is Family.GEMMA3:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
    return ["full_attention"] * n_layers


def _base_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        params = params["full_attention"]
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _rope_tables(cfg: dict, head_dim: int, layer_types: list[str]) -> tuple[list[RopeSpec], tuple[int, ...]]:
    """One RopeSpec per distinct layer type's rope parameters (transformers' own init functions for scaled
    types; both `rope_scaling` and transformers 5's `rope_parameters` spellings, normalised by its config class)."""
    from transformers import AutoConfig

    kwargs = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "transformers_version")}
    hf = AutoConfig.for_model(cfg.get("model_type", "llama"), **kwargs)
    params = hf.rope_parameters or {}
    per_type = isinstance(params, dict) and any(isinstance(v, dict) for v in params.values())
    specs: list[RopeSpec] = []
    index: dict[str, int] = {}
    layer_ropes = []
    for lt in layer_types:
        key = lt if per_type else "_"
        if key not in index:
            p = params[lt] if per_type else params
            index[key] = len(specs)
            specs.append(_rope_spec(hf, p, head_dim, lt if per_type else None))
        layer_ropes.append(index[key])
    return specs, tuple(layer_ropes) if len(specs) > 1 else ()


def _rope_spec(hf, params: dict, head_dim: int, layer_type: str | None) -> RopeSpec:
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0) or 10000.0))
    if rope_type == "default":
        return RopeSpec(default_inv_freq(theta, head_dim))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r} (supported: {', '.join(ROPE_TYPES)}): {params!r}")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", **kwargs)
    return RopeSpec(inv_freq.float(), float(scaling))


# ---- ops chosen once per backend ---------------------------------------------------------------------------


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
        return self.m.silu_mul(gate_up) if activation is Activation.SILU else TorchOps.act_mul(gate_up, activation)

    def rotary_(self, qkv, n, cos, sin):
        self.m.rotary_(qkv, n, cos, sin)


def select_ops(device: torch.device | str, dtype: torch.dtype, fused: bool = True) -> TorchOps:
    """FusedOps for float32 on CPU when the C++ module built (`fused` False: TANDEM_FUSED_OPS=0 turns them off),
    else TorchOps."""
    if torch.device(device).type == "cpu" and dtype == torch.float32 and fused and quant.available():
        return FusedOps(quant._module())
    return TorchOps()


# ---- the model ---------------------------------------------------------------------------------------------


class ConcatLinear(nn.Module):
    """Projections whose weights could not be fused (parts stored in different formats): outputs concatenated."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class Norm(nn.Module):
    """An RMSNorm's weight as the layer multiplies by it (Gemma's 1 + w already added at load) and its eps."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, a: DecoderArgs, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.scale = a.attn_scale if a.attn_scale is not None else a.head_dim ** -0.5
        self.window = a.window(layer)
        self.softcap = a.attn_softcap
        self.rope = a.rope_index(layer)
        self.qkv_proj: nn.Module = nn.Linear(a.hidden_size, (a.num_heads + 2 * a.num_kv_heads) * a.head_dim,
                                             bias=a.attention_bias)
        self.o_proj: nn.Module = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        self.q_norm = Norm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = Norm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None


class MLP(nn.Module):
    def __init__(self, a: DecoderArgs) -> None:
        super().__init__()
        self.gate_up_proj: nn.Module = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj: nn.Module = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, a: DecoderArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(a, layer)
        self.mlp = MLP(a)
        self.attn_norm = Norm(a.hidden_size, a.rms_norm_eps)
        self.mlp_norm = Norm(a.hidden_size, a.rms_norm_eps)
        self.attn_post_norm = Norm(a.hidden_size, a.rms_norm_eps) if a.sandwich_norms else None
        self.mlp_post_norm = Norm(a.hidden_size, a.rms_norm_eps) if a.sandwich_norms else None


class DecoderBody(nn.Module):
    def __init__(self, a: DecoderArgs) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(a.num_layers))
        self.norm = Norm(a.hidden_size, a.rms_norm_eps)


class RopeTable(nn.Module):
    """cos/sin of one RopeSpec for every position up to max_positions, [P, D]."""

    def __init__(self, spec: RopeSpec, max_positions: int) -> None:
        super().__init__()
        inv_freq = spec.inv_freq.float()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * spec.attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * spec.attention_scaling, persistent=False)


class DecoderForCausalLM(nn.Module):
    def __init__(self, a: DecoderArgs) -> None:
        super().__init__()
        self.args = a
        self.model = DecoderBody(a)
        self.ropes = nn.ModuleList(RopeTable(s, a.max_position_embeddings) for s in a.ropes)
        self.lm_head: nn.Module = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.ops: TorchOps = TorchOps()
        self.walker = None  # the C++ layer walker of small decode steps (`layer_walker`), when the model has one
        self.kernels = "auto"  # the attention backend (TANDEM_KERNELS, kernels/dispatch.py)

    def use_ops(self, ops: TorchOps, walker=None, kernels: str = "auto") -> "DecoderForCausalLM":
        self.ops, self.walker, self.kernels = ops, walker, kernels
        return self

    def forward(self, input_ids, positions, kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat ragged batch; kv_caches is [layers, 2, blocks, block, Hkv, D]."""
        a, ops = self.args, self.ops
        x = self.model.embed_tokens(input_ids)
        if a.embed_scale:
            x = x * torch.tensor(a.hidden_size ** 0.5, dtype=x.dtype)
        tables = [(r.cos[positions].to(x.dtype).contiguous(), r.sin[positions].to(x.dtype).contiguous())
                  for r in self.ropes]
        layers = self.model.layers
        residual = x.contiguous() if a.embed_scale else x.clone()  # updated in place from here on
        h = ops.add_rms_norm(None, residual, layers[0].attn_norm.weight, a.rms_norm_eps)
        T = h.shape[0]
        # Decided once for all layers: backend, decode-only or mixed, which slots to write.
        paged = kernels.plan_step(meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc, h,
                                  kv_caches, self.kernels)
        if self.walker is not None and paged.backend == "cpp" and paged.decode_only and T <= quant.small_m(
                quant.cpu_isa()):  # a few sequences decoding: every layer in one C++ call
            return self.walker.forward(h, residual, kv_caches, [c for c, _ in tables], [s for _, s in tables],
                                       paged.slot_mapping, paged.block_tables, paged.seq_lens, int(quant.cpu_isa()))
        keys, values = kv_caches.unbind(1)  # [layers, blocks, ...] each: two views here, not two per layer
        for i, (layer, k_cache, v_cache) in enumerate(zip(layers, keys.unbind(0), values.unbind(0))):
            attn = layer.self_attn
            nq, nkv = attn.num_heads, attn.num_kv_heads
            qkv = attn.qkv_proj(h).view(T, nq + 2 * nkv, attn.head_dim)
            if attn.q_norm is not None:
                qkv[:, :nq] = ops.rms_norm(qkv[:, :nq], attn.q_norm.weight, a.rms_norm_eps)
                qkv[:, nq:nq + nkv] = ops.rms_norm(qkv[:, nq:nq + nkv], attn.k_norm.weight, a.rms_norm_eps)
            ops.rotary_(qkv, nq + nkv, *tables[attn.rope])
            o = kernels.write_and_attend(paged, qkv, nq, k_cache, v_cache, attn.scale, attn.window, attn.softcap)
            o = attn.o_proj(o.view(T, -1))
            if layer.attn_post_norm is not None:
                o = ops.rms_norm(o, layer.attn_post_norm.weight, a.rms_norm_eps)
            h = ops.add_rms_norm(o, residual, layer.mlp_norm.weight, a.rms_norm_eps)
            m = layer.mlp.down_proj(ops.act_mul(layer.mlp.gate_up_proj(h), a.activation))
            if layer.mlp_post_norm is not None:
                m = ops.rms_norm(m, layer.mlp_post_norm.weight, a.rms_norm_eps)
            norm = layers[i + 1].attn_norm if i + 1 < len(layers) else self.model.norm
            h = ops.add_rms_norm(m, residual, norm.weight, a.rms_norm_eps)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.soft_cap(self.lm_head(hidden).float())

    def soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.args.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def lm_head_rows(self, ids: list[int]) -> torch.Tensor:
        """Rows `ids` of the LM head's weight, dense (a quantized head dequantizes only those)."""
        rows = getattr(self.lm_head, "rows", None)
        return rows(ids) if rows is not None else self.lm_head.weight[ids]


# ---- the one loader: HF-named tensors (dense or GGUF blocks) into the model ----------------------------------

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
                activations: quant.Activations = quant.Activations.FLOAT32) -> nn.Module:
    """One module computing the concatenated outputs of these row blocks: rows fused into one matrix when the parts
    share a format (blocks concatenate as stored: rows are independent), else a ConcatLinear of the parts."""
    bias = torch.cat(biases).to(dtype) if biases else None
    if all(isinstance(w, QuantWeight) for w in weights) and len({w.fmt for w in weights}) == 1:
        first = weights[0]
        data = torch.cat([w.data for w in weights]) if len(weights) > 1 else first.data
        scales = (torch.cat([w.scales for w in weights]) if first.scales is not None and len(weights) > 1
                  else first.scales)
        qw = QuantWeight(data, first.fmt, (sum(w.shape[0] for w in weights), first.shape[1]), scales)
        return QuantizedLinear(qw, bias, activations)
    if all(isinstance(w, torch.Tensor) for w in weights):
        dense = torch.cat(weights).to(dtype) if len(weights) > 1 else weights[0].to(dtype)
        lin = nn.Linear(dense.shape[1], dense.shape[0], bias=bias is not None, device="meta")
        lin.weight = nn.Parameter(dense, requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias, requires_grad=False)
        return lin
    parts = [make_linear([w], None if biases is None else [b], dtype, activations) for w, b in
             zip(weights, biases or [None] * len(weights))]
    return ConcatLinear(parts)


def build_decoder(args: DecoderArgs, weights: dict[str, Weight], device: str = "cpu",
                  dtype: torch.dtype = torch.float32,
                  activations: quant.Activations = quant.Activations.FLOAT32,
                  settings: Settings | None = None) -> DecoderForCausalLM:
    """The model holding these HF-named weights (rotary buffers and transformers' extras ignored); a missing or
    unexpected tensor is a ValueError naming it. `activations`: what quantized projections multiply with;
    `settings`: the kernel backend, fused ops and layer walker (None: the defaults)."""
    settings = settings or Settings()
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
        model.model.embed_tokens = QuantizedEmbedding(embed)
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
                setattr(getattr(layer, parent), attr, make_linear(ws, biases, dtype, activations))
        for ours, hf in _SINGLE.items():
            w = take(p + hf + ".weight")
            if w is not None:
                parent, attr = ours.split(".")
                setattr(getattr(layer, parent), attr, make_linear([w], None, dtype, activations))
        for ours, hf in names.items():
            getattr(layer, ours).weight = nn.Parameter(norm_weight(p + hf + ".weight"), requires_grad=False)
        if args.qk_norm:
            attn.q_norm.weight = nn.Parameter(norm_weight(p + "self_attn.q_norm.weight"), requires_grad=False)
            attn.k_norm.weight = nn.Parameter(norm_weight(p + "self_attn.k_norm.weight"), requires_grad=False)
    model.model.norm.weight = nn.Parameter(norm_weight("model.norm.weight"), requires_grad=False)
    if args.tie_word_embeddings:
        used.add("lm_head.weight")
        emb = model.model.embed_tokens
        model.lm_head = (QuantizedLinear(emb.qweight, None, activations) if isinstance(emb, QuantizedEmbedding) else
                         _linear_from(emb.weight))
    else:
        head = take("lm_head.weight")
        if head is not None:
            model.lm_head = make_linear([head], None, dtype, activations)
    unexpected = sorted(set(weights) - used)
    if missing or unexpected:
        raise ValueError(f"weights do not match the {args.family.value} model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.ropes = nn.ModuleList(RopeTable(s, args.max_position_embeddings) for s in args.ropes)
    model = model.to(device).eval()
    ops = select_ops(device, dtype, settings.fused_ops)
    walker = layer_walker(model) if isinstance(ops, FusedOps) and settings.layer_walker else None
    return model.use_ops(ops, walker, settings.kernels)


def layer_walker(model: DecoderForCausalLM):
    """The C++ walker of this model's layers (kernels/quant.py `decode_layers`), or None where it does not apply:
    the C++ modules not built, or a projection that is not float32-activation blocks in a C++ format (dense weights,
    `--cpu-activations int8`, F16 / BF16 tensors). TANDEM_LAYER_WALKER=0 (A/B runs) keeps build_decoder from asking."""
    a = model.args
    walker = quant.decode_layers(a.num_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps,
                                 a.activation is Activation.GELU_TANH)
    if walker is None:
        return None
    layers = model.model.layers
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        projections = [_walker_projection(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(p is None for p in projections):
            return None
        weight = lambda norm: None if norm is None else norm.weight  # noqa: E731
        next_norm = layers[i + 1].attn_norm if i + 1 < len(layers) else model.model.norm
        walker.add_layer(*projections, weight(attn.q_norm), weight(attn.k_norm), weight(layer.attn_post_norm),
                         layer.mlp_norm.weight, weight(layer.mlp_post_norm), next_norm.weight, attn.scale,
                         attn.window, attn.softcap, attn.rope)
    return walker


def _walker_projection(module: nn.Module):
    """A walker projection of a QuantizedLinear or a ConcatLinear of them (float32 activations, C++ formats)."""
    parts = list(module.parts) if isinstance(module, ConcatLinear) else [module]
    if not all(isinstance(p, QuantizedLinear) and p.activations is quant.Activations.FLOAT32
               and p.qweight.fmt in quant.CPP_FORMATS for p in parts):
        return None
    biases = [p.bias for p in parts]
    bias = None
    if any(b is not None for b in biases):  # a part without one adds zeros
        bias = torch.cat([b.detach() if b is not None else torch.zeros(p.out_features)
                          for b, p in zip(biases, parts)]).float().contiguous()
    return quant.projection([p.qweight for p in parts], bias)


def _linear_from(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    return lin


def kv_bytes_per_token(args: DecoderArgs, itemsize: int) -> int:
    """KV cache bytes one token of one sequence holds (every layer keeps every block: see docs/models.md)."""
    return args.num_layers * 2 * args.num_kv_heads * args.head_dim * itemsize
