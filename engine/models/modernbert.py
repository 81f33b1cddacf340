"""ModernBERT sequence classifiers (gte-reranker-modernbert-base) over one packed ragged batch.

Pre-LN layers without biases, rotary attention with a different base for local and global layers, local layers
attending within +-sliding_window tokens (transformers' bidirectional sliding-window mask, `|i - j| <= window`),
GeGLU MLP, final norm, then CLS or mean pooling, a dense + activation + LayerNorm head and the classifier. Module and
parameter names mirror transformers' (`model.*`, `head.*`, `classifier.*`) so an HF state dict loads as is. Each
sequence attends in its own SDPA call: correct first, not tuned.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


@dataclass(slots=True)
class ModernBertArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    classifier_bias: bool
    hidden_activation: str
    classifier_activation: str
    classifier_pooling: str  # "cls" | "mean"
    layer_windows: tuple[int, ...]  # per layer: half window (|i - j| <= w), 0 = global
    layer_thetas: tuple[float, ...]  # per layer rope base
    max_position_embeddings: int
    pad_token_id: int
    num_labels: int

    @classmethod
    def from_hf_config(cls, cfg: dict, num_labels: int) -> "ModernBertArgs":
        from transformers import AutoConfig

        hf = AutoConfig.for_model("modernbert", **{k: v for k, v in cfg.items() if k not in (
            "model_type", "architectures", "transformers_version")})
        if hf.classifier_pooling not in ("cls", "mean"):
            raise ValueError(f"unsupported classifier_pooling {hf.classifier_pooling!r}")
        rope = hf.rope_parameters
        windows = tuple(hf.sliding_window if t == "sliding_attention" else 0 for t in hf.layer_types)
        thetas = tuple(float(rope[t]["rope_theta"]) for t in hf.layer_types)
        for t in hf.layer_types:
            if rope[t].get("rope_type", "default") != "default":
                raise ValueError(f"unsupported ModernBERT rope type {rope[t]!r}")
        return cls(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                   num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads, norm_eps=hf.norm_eps,
                   norm_bias=hf.norm_bias, attention_bias=hf.attention_bias, mlp_bias=hf.mlp_bias,
                   classifier_bias=hf.classifier_bias, hidden_activation=hf.hidden_activation,
                   classifier_activation=hf.classifier_activation, classifier_pooling=hf.classifier_pooling,
                   layer_windows=windows, layer_thetas=thetas, max_position_embeddings=hf.max_position_embeddings,
                   pad_token_id=hf.pad_token_id if hf.pad_token_id is not None else 0, num_labels=num_labels)

    @property
    def max_tokens(self) -> int:
        return self.max_position_embeddings


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Embeddings(nn.Module):
    def __init__(self, a: ModernBertArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.norm = nn.LayerNorm(a.hidden_size, eps=a.norm_eps, bias=a.norm_bias)


class Attention(nn.Module):
    def __init__(self, a: ModernBertArgs) -> None:
        super().__init__()
        self.Wqkv = nn.Linear(a.hidden_size, 3 * a.hidden_size, bias=a.attention_bias)
        self.Wo = nn.Linear(a.hidden_size, a.hidden_size, bias=a.attention_bias)


class MLP(nn.Module):
    def __init__(self, a: ModernBertArgs) -> None:
        super().__init__()
        self.Wi = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=a.mlp_bias)
        self.Wo = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)


class Layer(nn.Module):
    def __init__(self, a: ModernBertArgs, i: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(a.hidden_size, eps=a.norm_eps, bias=a.norm_bias) if i else nn.Identity()
        self.attn = Attention(a)
        self.mlp_norm = nn.LayerNorm(a.hidden_size, eps=a.norm_eps, bias=a.norm_bias)
        self.mlp = MLP(a)


class Body(nn.Module):
    def __init__(self, a: ModernBertArgs) -> None:
        super().__init__()
        self.embeddings = Embeddings(a)
        self.layers = nn.ModuleList(Layer(a, i) for i in range(a.num_layers))
        self.final_norm = nn.LayerNorm(a.hidden_size, eps=a.norm_eps, bias=a.norm_bias)


class Head(nn.Module):
    def __init__(self, a: ModernBertArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(a.hidden_size, a.hidden_size, bias=a.classifier_bias)
        self.norm = nn.LayerNorm(a.hidden_size, eps=a.norm_eps, bias=a.norm_bias)


class ModernBertForSequenceClassification(nn.Module):
    base_model_prefix = "model"

    def __init__(self, a: ModernBertArgs) -> None:
        super().__init__()
        self.args = a
        self.model = Body(a)
        self.head = Head(a)
        self.classifier = nn.Linear(a.hidden_size, a.num_labels)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, cu_seqlens: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Packed tokens [T] and cu_seqlens [B + 1] -> logits [B, num_labels] (token types are not used)."""
        return self.classify(encode(self.model, self.args, input_ids, cu_seqlens), cu_seqlens)

    def classify(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Every token's final-normed state [T, hidden] -> logits [B, num_labels]."""
        a = self.args
        bounds = cu_seqlens.tolist()
        head_act = ACT2FN[a.classifier_activation]
        if a.classifier_pooling == "cls":
            pooled = x[cu_seqlens[:-1].long()]
        else:
            pooled = torch.stack([x[s:e].mean(0) for s, e in zip(bounds[:-1], bounds[1:])])
        return self.classifier(self.head.norm(head_act(self.head.dense(pooled))))


def encode(body: Body, a: ModernBertArgs, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The final-normed hidden state of every token [T, hidden] of a packed batch (a classifier pools it, an
    embedder too: engine/embed/, which runs the same three parts a few layers a step)."""
    x = embed_tokens(body, input_ids)
    x = run_layers(body, a, x, cu_seqlens, 0, a.num_layers)
    return body.final_norm(x)


def embed_tokens(body: Body, input_ids: torch.Tensor) -> torch.Tensor:
    """The first layer's input [T, hidden]."""
    return body.embeddings.norm(body.embeddings.tok_embeddings(input_ids))


def run_layers(body: Body, a: ModernBertArgs, x: torch.Tensor, cu_seqlens: torch.Tensor, start: int, stop: int
               ) -> torch.Tensor:
    """Layers start..stop-1 over a packed batch's hidden states (each sequence attends within itself)."""
    bounds = cu_seqlens.tolist()
    heads, dim = a.num_heads, a.hidden_size // a.num_heads
    longest = max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    pos = torch.arange(longest, dtype=torch.float32, device=x.device)
    tables = {}
    for theta in set(a.layer_thetas[start:stop]):
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=x.device).float() / dim))
        emb = torch.cat([torch.outer(pos, inv)] * 2, dim=-1)
        tables[theta] = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
    act = ACT2FN[a.hidden_activation]
    for layer, window, theta in zip(body.layers[start:stop], a.layer_windows[start:stop], a.layer_thetas[start:stop]):
        qkv = layer.attn.Wqkv(layer.attn_norm(x)).view(-1, 3, heads, dim)
        cos, sin = tables[theta]
        out = torch.empty(x.shape[0], heads, dim, dtype=x.dtype, device=x.device)
        for s, e in zip(bounds[:-1], bounds[1:]):
            n = e - s
            q, k, v = (qkv[s:e, j].transpose(0, 1) for j in range(3))  # [heads, n, dim]
            q, k = _rotate(q, cos[:n], sin[:n]), _rotate(k, cos[:n], sin[:n])
            mask = None
            if window:
                idx = torch.arange(n, device=x.device)
                mask = (idx[:, None] - idx[None, :]).abs() <= window
            out[s:e] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)
        x = x + layer.attn.Wo(out.reshape(x.shape[0], -1))
        inp, gate = layer.mlp.Wi(layer.mlp_norm(x)).chunk(2, dim=-1)
        x = x + layer.mlp.Wo(act(inp) * gate)
    return x
