"""The one decoder definition (Llama, SmolLM, Mistral, Qwen2/3, Gemma 2/3) over a flat ragged batch with a paged
KV cache.

The layer is written once (`DecoderForCausalLM.forward`); what differs between families is data in `DecoderArgs`
(engine/models/decoder_args.py), and what differs between backends is an `Ops` object chosen once at build
(engine/models/decoder_ops.py) and the attention backend (`kernels`, TANDEM_KERNELS). The weights are put in by
engine/models/decoder_weights.py `build_decoder`; a small CPU decode step may run every layer in one C++ call
(engine/models/decoder_walker.py).
"""
from __future__ import annotations

import torch
from torch import nn

import kernels
from kernels import quant
from engine.attention import AttentionMetadata
from engine.models.decoder_args import DecoderArgs, RopeSpec
from engine.models.decoder_ops import TorchOps


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
        self.walker_rows = 0  # the widest decode step it takes (decoder_walker.walker_rows)
        self.kernels = "auto"  # the attention backend (TANDEM_KERNELS, kernels/dispatch.py)
        # the CPU path its quantized weights multiply on (build_decoder: the builder's, from the settings); None where
        # no weight is quantized. The walker and narrow_rows read it; two models in one process may hold different ones
        self.cpu_path: quant.CpuPath | None = None

    def use_ops(self, ops: TorchOps, walker=None, kernels: str = "auto", walker_rows: int = 0) -> "DecoderForCausalLM":
        self.ops, self.walker, self.kernels, self.walker_rows = ops, walker, kernels, walker_rows
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
        if self.walker is not None and paged.backend == "cpp" and paged.decode_only and T <= self.walker_rows:
            # sequences decoding, as many as every projection's in-register kernel takes: every layer in one C++ call,
            # on the model's CPU path
            isa = (self.cpu_path or quant.default_cpu_path()).isa
            return self.walker.forward(h, residual, kv_caches, [c for c, _ in tables], [s for _, s in tables],
                                       paged.slot_mapping, paged.block_tables, paged.seq_lens, int(isa))
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
