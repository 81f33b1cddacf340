"""Llama-family decoder (Llama, SmolLM, Qwen2/3) over one flat ragged batch with a paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

import kernels
from kernels import quant
from engine.attention import AttentionMetadata

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


@dataclass(slots=True)
class LlamaArgs:
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
    attention_bias: bool  # Qwen2 has q/k/v biases
    qk_norm: bool  # Qwen3 normalises q and k per head

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "LlamaArgs":
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        if archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"unsupported rope scaling {rope!r}")
        heads = cfg["num_attention_heads"]
        qwen2 = archs[0] == "Qwen2ForCausalLM"
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", qwen2),
            qk_norm=archs[0] == "Qwen3ForCausalLM",
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op instead of five: matters for small decode batches
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()  # half precision: normalise in fp32 first, as transformers does
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions as [T, 1, D]; looked up once per forward, shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.scale = a.head_dim ** -0.5
        # q, k and v in one matmul (HF's separate weights are concatenated at load time).
        self.qkv_proj = nn.Linear(a.hidden_size, (a.num_heads + 2 * a.num_kv_heads) * a.head_dim,
                                  bias=a.attention_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor, meta: AttentionMetadata):
        T = x.shape[0]
        qkv = self.qkv_proj(x).view(T, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        o = kernels.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale)
        return self.o_proj(o.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.intermediate_size = a.intermediate_size
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)  # fused at load
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Weight names match Hugging Face's, so an HF state dict loads as is."""

    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.args = a
        self.model = LlamaBody(a)
        self.rotary = Rotary(a.head_dim, a.rope_theta, a.max_position_embeddings)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat ragged batch; kv_caches is [layers, 2, blocks, block, Hkv, D]."""
        x = self.model.embed_tokens(input_ids)
        ops = None if self.args.qk_norm else quant.fused_ops(x)
        if ops is not None:
            return self._forward_fused(ops, x, positions, kv_caches, meta)
        rope = self.rotary.tables(positions, x.dtype)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, rope, kv, meta)
        return self.model.norm(x)

    def _forward_fused(self, ops, x, positions, kv_caches, meta) -> torch.Tensor:
        """The same arithmetic on CPU float32 with the residual add + RMSNorm, SiLU * up and RoPE each one call
        (kernels/quant.py): at batch 1 the ~25 small torch ops per layer cost as much as the matmuls."""
        layers = self.model.layers
        cos, sin = self.rotary.cos[positions], self.rotary.sin[positions]
        residual = x.contiguous()  # a fresh tensor from the embedding: updated in place from here on
        h = ops.add_rms_norm(None, residual, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
            attn = layer.self_attn
            T = h.shape[0]
            qkv = attn.qkv_proj(h).view(T, attn.num_heads + 2 * attn.num_kv_heads, attn.head_dim)
            ops.rotary_(qkv, attn.num_heads + attn.num_kv_heads, cos, sin)
            q, k, v = qkv.split([attn.num_heads, attn.num_kv_heads, attn.num_kv_heads], dim=1)
            kernels.write_kv_cache(k, v, kv[0], kv[1], meta.slot_mapping)
            o = kernels.paged_attention(q, kv[0], kv[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                        attn.scale)
            norm = layer.post_attention_layernorm
            h = ops.add_rms_norm(attn.o_proj(o.reshape(T, -1)), residual, norm.weight, norm.eps)
            mlp = layer.mlp
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h = ops.add_rms_norm(mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(h))), residual, norm.weight, norm.eps)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def lm_head_rows(self, ids: list[int]) -> torch.Tensor:
        """Rows `ids` of the LM head's weight, dense (a quantized head dequantizes only those)."""
        rows = getattr(self.lm_head, "rows", None)
        return rows(ids) if rows is not None else self.lm_head.weight[ids]

    def load_hf_state_dict(self, state: dict[str, torch.Tensor], assign: bool = False) -> None:
        """Load HF-named weights; with assign=True a model built on the meta device takes the tensors."""
        a = self.args
        state = _fuse_projections(state)
        if a.tie_word_embeddings:
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        missing, unexpected = self.load_state_dict(state, strict=False, assign=assign)
        missing = [m for m in missing if not (m == "lm_head.weight" and a.tie_word_embeddings)]
        unexpected = [u for u in unexpected if "rotary_emb" not in u]
        if missing or unexpected:
            raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if a.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if self.rotary.cos.is_meta:
            self.rotary = Rotary(a.head_dim, a.rope_theta, a.max_position_embeddings)


_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenate HF's separate q/k/v and gate/up weights (and biases) into our fused ones."""
    state = dict(state)
    for key in [k for k in state if ".self_attn.q_proj." in k or ".mlp.gate_proj." in k]:
        layer, _, rest = key.partition(".self_attn." if ".self_attn." in key else ".mlp.")
        kind = rest.split(".")[-1]  # weight | bias
        for fused, parts in _FUSED.items():
            names = [f"{layer}.{p}.{kind}" for p in parts]
            if names[0] == key:
                state[f"{layer}.{fused}.{kind}"] = torch.cat([state.pop(n) for n in names], dim=0)
    return state
