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
from kernels.linear import Activation, linear, linear_add

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
            raise ValueError(f"unsupported cross-encoder model_type {model_type!r}; supported: "
                             f"{', '.join([*FAMILIES, 'modernbert'])}")
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


def longest_first(cu_seqlens: torch.Tensor, *per_token: torch.Tensor
                  ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...], torch.Tensor]:
    """The packed batch reordered so its sequences run from longest to shortest (stable among equal lengths):
    (order, per-token tensors reordered, new cu_seqlens); order is None when the batch already runs that way.
    Sequence i of the new batch is sequence order[i] of the old one."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    if lens.shape[0] < 2 or bool((lens[1:] <= lens[:-1]).all()):
        return None, per_token, cu_seqlens
    order = torch.sort(lens, descending=True, stable=True).indices
    new_lens = lens[order].long()
    new_cu = torch.zeros_like(cu_seqlens)
    torch.cumsum(new_lens, 0, out=new_cu[1:])
    # Token t of new sequence i comes from old position old_start[order[i]] + (t - new_start[i]).
    shift = torch.repeat_interleave(cu_seqlens[:-1].long()[order] - new_cu[:-1].long(), new_lens)
    index = torch.arange(int(new_cu[-1]), device=cu_seqlens.device) + shift
    return order, tuple(t.index_select(0, index) for t in per_token), new_cu


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
        self._fused_cache: dict[int, tuple] = {}  # not a buffer: the state dict keeps HF's three projections
        self.kernels = "auto"  # the attention backend (TANDEM_KERNELS): `use_kernels`

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output of every token [T, H], or with `rows` (each sequence's first token) of those only."""
        shape = (x.shape[0], self.num_heads, self.head_dim)
        if rows is not None:
            k, v = linear(x, *self._fused(self.key, self.value), mode=self.kernels).view(
                x.shape[0], 2, *shape[1:]).unbind(1)
            q = self.query(x[rows]).view(rows.shape[0], self.num_heads, self.head_dim)
            return first_token_attention(q, k, v, cu_seqlens, self.scale).reshape(rows.shape[0], -1)
        # One GEMM for Q, K and V (three [T, H] outputs side by side), attended as one tensor: no copies.
        qkv = linear(x, *self._fused(self.query, self.key, self.value), mode=self.kernels).view(
            x.shape[0], 3, *shape[1:])
        return kernels.varlen_attention_qkv(qkv, cu_seqlens, self.scale, self.kernels).reshape(x.shape[0], -1)

    def _fused(self, *projs: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """The projections' weights and biases concatenated, built once and rebuilt if a weight changes."""
        key = tuple((p.weight.data_ptr(), p.weight._version, p.bias.data_ptr(), p.bias._version) for p in projs)
        cached = self._fused_cache.get(len(projs))
        if cached is None or cached[0] != key:
            cached = (key, torch.cat([p.weight for p in projs]), torch.cat([p.bias for p in projs]))
            self._fused_cache[len(projs)] = cached
        return cached[1], cached[2]


def first_token_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Attention of one query row per sequence (q [B, heads, D]) over that sequence's keys (k, v [T, heads, D]).

    The last layer only feeds the classifier its sequences' first tokens, so their rows are all it attends for:
    a softmax per sequence over its own tokens (segment max and sums), no [L, L] scores and no per-sequence calls.
    """
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=k.device), lens)  # [T] sequence of each token
    scores = (q.index_select(0, seq) * k).sum(-1) * scale  # [T, heads]
    index = seq[:, None].expand_as(scores)
    top = scores.new_full(q.shape[:2], -torch.inf).scatter_reduce_(0, index, scores, "amax")
    p = (scores - top.index_select(0, seq)).exp_()
    total = scores.new_zeros(q.shape[:2]).index_add_(0, seq, p)
    out = q.new_zeros(q.shape).index_add_(0, seq, p[..., None] * v)
    return out / total[..., None]


class DenseLayerNorm(nn.Module):
    """dense, then LayerNorm over the residual sum: HF's BertSelfOutput and BertOutput."""

    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)
        self.kernels = "auto"  # the linear's backend (TANDEM_KERNELS): `use_kernels`

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(linear_add(x, self.dense.weight, self.dense.bias, residual, self.kernels))


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
        self.fused_act = Activation.from_hf(a.hidden_act)  # None: applied after the linear, as transformers does
        self.kernels = "auto"  # the linear's backend (TANDEM_KERNELS): `use_kernels`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_act is None:
            return self.act(self.dense(x))
        return linear(x, self.dense.weight, self.dense.bias, self.fused_act, self.kernels)  # the GELU inside the GEMM


class Layer(nn.Module):
    """Post-LN transformer layer."""

    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.attention = Attention(a)
        self.intermediate = Intermediate(a)
        self.output = DenseLayerNorm(a.intermediate_size, a.hidden_size, a.layer_norm_eps)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`rows`: keep only these tokens after attention (the last layer only needs each pair's first token)."""
        ctx = self.attention.self(x, cu_seqlens, rows)
        if rows is not None:
            x = x[rows]
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
        # Longest sequences first, so the attention kernel finds runs of similar length to batch into one call;
        # only token ids move here, and the outputs go back to input order at the end.
        order, (input_ids, token_type_ids, positions), cu_seqlens = longest_first(
            cu_seqlens, input_ids, token_type_ids, positions)
        x = self.embeddings(input_ids, token_type_ids, positions)
        first = cu_seqlens[:-1].long()
        layers = self.encoder.layer
        for i, layer in enumerate(layers):
            x = layer(x, cu_seqlens, first if i == len(layers) - 1 else None)
        x = x if len(layers) else x[first]
        return x if order is None else x[torch.argsort(order)]


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


def use_kernels(model: nn.Module, mode: str) -> None:
    """Run every attention and linear of `model` on the backend `mode` names (TANDEM_KERNELS, kernels/dispatch.py)."""
    for module in model.modules():
        if isinstance(module, (SelfAttention, DenseLayerNorm, Intermediate)):
            module.kernels = mode


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
           "pack_pairs", "packed_positions", "longest_first", "first_token_attention", "FAMILIES"]
