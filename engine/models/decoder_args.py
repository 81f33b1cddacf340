"""What differs between the decoder families, as data: `DecoderArgs` read from a Hugging Face config (norm placement,
(1 + w) norms, activation, q/k norms, sliding windows, rope tables, soft-caps), and the one table of the
architectures tandem serves."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class Family(Enum):
    LLAMA = "llama"  # Llama, SmolLM, Mistral
    QWEN2 = "qwen2"  # q/k/v biases
    QWEN3 = "qwen3"  # q/k norms
    GEMMA2 = "gemma2"  # sandwich norms, (1 + w), GeGLU, scaled embeddings, soft-caps, sliding windows
    GEMMA3 = "gemma3"  # Gemma 2 without soft-caps, with q/k norms and a second rope base for sliding layers


@dataclass(frozen=True, slots=True)
class Architecture:
    """A decoder tandem serves: its transformers class name, its family, the `model_type`s a config of it carries
    and the `general.architecture` of its GGUF files."""
    name: str
    family: Family
    model_types: tuple[str, ...]
    gguf: str


# The one table of served architectures: HF configs, GGUF files (engine/models/gguf_file.py) and errors read it.
ARCHITECTURES = (
    Architecture("LlamaForCausalLM", Family.LLAMA, ("llama",), "llama"),
    Architecture("MistralForCausalLM", Family.LLAMA, ("mistral",), "mistral"),
    Architecture("Qwen2ForCausalLM", Family.QWEN2, ("qwen2",), "qwen2"),
    Architecture("Qwen3ForCausalLM", Family.QWEN3, ("qwen3",), "qwen3"),
    Architecture("Gemma2ForCausalLM", Family.GEMMA2, ("gemma2",), "gemma2"),
    Architecture("Gemma3ForCausalLM", Family.GEMMA3, ("gemma3_text", "gemma3"), "gemma3"),
)


def architecture(cfg: dict) -> Architecture:
    """The row of an HF config: by its `architectures`, else by its model_type (a GGUF file's config, read by
    transformers, has none); a ValueError naming the supported ones otherwise."""
    names = cfg.get("architectures")
    for a in ARCHITECTURES:
        if (a.name == names[0]) if names else (cfg.get("model_type", "llama") in a.model_types):
            return a
    arch = names[0] if names else "?"
    raise ValueError(f"unsupported architecture {arch!r} (model_type {cfg.get('model_type')!r}); "
                     f"supported: {', '.join(a.name for a in ARCHITECTURES)}")
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
        arch = architecture(cfg)
        family = arch.family
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        gemma = family in (Family.GEMMA2, Family.GEMMA3)
        n_layers = cfg["num_hidden_layers"]
        layer_types = _layer_types(cfg, family, n_layers)
        window = cfg.get("sliding_window") or 0
        if family is Family.LLAMA and arch.name == "MistralForCausalLM" and window and window < cfg.get(
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
