"""BERT / RoBERTa / XLM-R sequence classifiers (cross-encoders) over one packed ragged batch, no padding.

Module and parameter names mirror transformers' so an HF state dict loads as is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers.activations import ACT2FN

import kernels

# model_type -> family: picks head and position scheme, and is the base-model prefix of HF weight names
FAMILIES: dict[str, Literal["bert", "roberta"]] = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta"}


@dataclass(slots=True)
class EncoderArgs:
    family: Literal["bert", "roberta"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    hidden_act: str
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int
    pad_token_id: int
    num_labels: int

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_heads}")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}")
        if self.num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {self.num_labels}")

    @property
    def position_offset(self) -> int:
        """First position id of a sequence: RoBERTa counts from padding_idx + 1, BERT from 0."""
        return self.pad_token_id + 1 if self.family == "roberta" else 0

    @property
    def max_tokens(self) -> int:
        """Longest sequence the position table can embed."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf_config(cls, cfg: dict, num_labels: int) -> "EncoderArgs":
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"unsupported cross-encoder model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported position_embedding_type {cfg['position_embedding_type']!r}")
        if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
            raise ValueError("decoder / cross-attention BERT configs are not cross-encoders")
        family = FAMILIES[model_type]
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            hidden_act=cfg.get("hidden_act", "gelu"),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            max_position_embeddings=cfg.get("max_position_embeddings", 512),
            type_vocab_size=cfg.get("type_vocab_size", 2),
            pad_token_id=_default(cfg.get("pad_token_id"), 1 if family == "roberta" else 0),
            num_labels=num_labels,
        )


def _default(value: int | None, fallback: int) -> int:
    return fallback if value is None else value


def packed_positions(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, a: EncoderArgs) -> torch.Tensor:
    """Position ids per token, restarting at each sequence start, exactly as HF computes them unpadded."""
    starts = cu_seqlens[:-1].long()
    lens = cu_seqlens[1:].long() - starts
    if a.family == "bert":
        idx = torch.arange(input_ids.numel(), device=input_ids.device)
        return idx - torch.repeat_interleave(starts, lens)
    # RoBERTa: a pad id inside a sequence gets padding_idx and does not advance the count (HF's cumsum of the mask).
    mask = input_ids.ne(a.pad_token_id).long()
    total = mask.cumsum(0)
    before = torch.repeat_interleave(total[starts] - mask[starts], lens)
    return (total - before) * mask + a.pad_token_id


class Embeddings(nn.Module):
    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.position_embeddings = nn.Embedding(a.max_position_embeddings, a.hidden_size)
        self.token_type_embeddings = nn.Embedding(a.type_vocab_size, a.hidden_size)
        self.LayerNorm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions))


class SelfAttention(nn.Module):
    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.num_heads, self.head_dim = a.num_heads, a.hidden_size // a.num_heads
        self.scale = self.head_dim ** -0.5
        self.query = nn.Linear(a.hidden_size, a.hidden_size)
        self.key = nn.Linear(a.hidden_size, a.hidden_size)
        self.value = nn.Linear(a.hidden_size, a.hidden_size)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[0], self.num_heads, self.head_dim)
        q, k, v = (proj(x).view(shape) for proj in (self.query, self.key, self.value))
        return kernels.varlen_attention(q, k, v, cu_seqlens, self.scale).reshape(x.shape[0], -1)


class DenseLayerNorm(nn.Module):
    """dense, then LayerNorm over the residual sum: HF's BertSelfOutput and BertOutput."""

    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.self = SelfAttention(a)
        self.output = DenseLayerNorm(a.hidden_size, a.hidden_size, a.layer_norm_eps)


class Intermediate(nn.Module):
    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(a.hidden_size, a.intermediate_size)
        self.act = ACT2FN[a.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class Layer(nn.Module):
    """Post-LN transformer layer."""

    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.attention = Attention(a)
        self.intermediate = Intermediate(a)
        self.output = DenseLayerNorm(a.intermediate_size, a.hidden_size, a.layer_norm_eps)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`rows`: keep only these tokens after attention (the last layer only needs each pair's first token)."""
        ctx = self.attention.self(x, cu_seqlens)
        if rows is not None:
            ctx, x = ctx[rows], x[rows]
        h = self.attention.output(ctx, x)
        return self.output(self.intermediate(h), h)


class Encoder(nn.Module):
    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(a) for _ in range(a.num_layers))


class Pooler(nn.Module):
    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(a.hidden_size, a.hidden_size)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls))


class EncoderModel(nn.Module):
    """BertModel / RobertaModel body: returns the final hidden state of each sequence's first token [B, H]."""

    def __init__(self, a: EncoderArgs, pooler: bool) -> None:
        super().__init__()
        self.args = a
        self.embeddings = Embeddings(a)
        self.encoder = Encoder(a)
        self.pooler = Pooler(a) if pooler else None

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, cu_seqlens: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if positions is None:
            positions = packed_positions(input_ids, cu_seqlens, self.args)
        x = self.embeddings(input_ids, token_type_ids, positions)
        first = cu_seqlens[:-1].long()
        layers = self.encoder.layer
        for i, layer in enumerate(layers):
            x = layer(x, cu_seqlens, first if i == len(layers) - 1 else None)
        return x if len(layers) else x[first]


class ClassificationHead(nn.Module):
    """RobertaClassificationHead: dense + tanh + out_proj on the <s> token."""

    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(a.hidden_size, a.hidden_size)
        self.out_proj = nn.Linear(a.hidden_size, a.num_labels)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls)))


class BertForSequenceClassification(nn.Module):
    base_model_prefix = "bert"

    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.bert = EncoderModel(a, pooler=True)
        self.classifier = nn.Linear(a.hidden_size, a.num_labels)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, cu_seqlens: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Packed tokens [T] and cu_seqlens [B + 1] -> logits [B, num_labels]."""
        cls = self.bert(input_ids, token_type_ids, cu_seqlens, positions)
        return self.classifier(self.bert.pooler(cls))


class RobertaForSequenceClassification(nn.Module):
    """Also XLMRobertaForSequenceClassification: same weights layout, no pooler."""

    base_model_prefix = "roberta"

    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.roberta = EncoderModel(a, pooler=False)
        self.classifier = ClassificationHead(a)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, cu_seqlens: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Packed tokens [T] and cu_seqlens [B + 1] -> logits [B, num_labels]."""
        return self.classifier(self.roberta(input_ids, token_type_ids, cu_seqlens, positions))


SequenceClassifier = BertForSequenceClassification | RobertaForSequenceClassification


def build_model(a: EncoderArgs) -> SequenceClassifier:
    return BertForSequenceClassification(a) if a.family == "bert" else RobertaForSequenceClassification(a)


def pack_pairs(pairs: list[tuple[list[int], list[int]]], device: torch.device | str
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, token_type_ids) pairs -> flat input_ids [T], token_type_ids [T], cu_seqlens [B + 1] int32."""
    ids = [t for p in pairs for t in p[0]]
    types = [t for p in pairs for t in p[1]]
    lens = [len(p[0]) for p in pairs]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return (torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(types, dtype=torch.long, device=device),
            torch.tensor(cu, dtype=torch.int32, device=device))


__all__ = ["EncoderArgs", "BertForSequenceClassification", "RobertaForSequenceClassification", "build_model",
           "pack_pairs", "packed_positions", "FAMILIES"]
