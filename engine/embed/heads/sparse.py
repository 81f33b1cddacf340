"""Sparse embeddings (PoolingTask.SPARSE; EngineConfig.sparse_embedder, `tandem serve --sparse-embedder`): a SPLADE
masked-LM (BERT / RoBERTa / XLM-R with its MLM head) ending in one weight per vocabulary id [B, vocab]: max over the
row's tokens of log(1 + relu(logits)) (a packed row has no padding, so every token counts, as the attention mask
would have it); a row's output is its non-zero (vocabulary id, weight) pairs.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.config import EmbedParams, PoolingTask
from engine.embed.encoders import _bert
from engine.embed.heads import Encoder, Head, PoolingKind
from engine.models.bert import FAMILIES
from engine.models.loader import load_state_dict
from engine.models.stages import Stages
from engine.settings import Settings


class _MaskedLMHead(nn.Module):
    """BERT's cls.predictions / RoBERTa's lm_head: dense, activation, LayerNorm, then the (tied) decoder."""

    def __init__(self, hidden: int, vocab: int, eps: float, act: str) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.decoder = nn.Linear(hidden, vocab)
        self.act = {"gelu": nn.GELU(), "gelu_new": nn.GELU("tanh"), "relu": nn.ReLU()}[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(x))))


_MLM_KEYS = {  # our name: BERT's, RoBERTa's
    "dense.weight": ("cls.predictions.transform.dense.weight", "lm_head.dense.weight"),
    "dense.bias": ("cls.predictions.transform.dense.bias", "lm_head.dense.bias"),
    "norm.weight": ("cls.predictions.transform.LayerNorm.weight", "lm_head.layer_norm.weight"),
    "norm.bias": ("cls.predictions.transform.LayerNorm.bias", "lm_head.layer_norm.bias"),
    "decoder.bias": ("cls.predictions.bias", "lm_head.bias"),
}


def load_splade(path: Path, cfg: dict, device: torch.device, dtype: torch.dtype, settings: Settings) -> Head:
    if cfg.get("model_type") not in FAMILIES:
        raise ValueError(f"sparse embedder {str(path)!r} is a {cfg.get('model_type')!r}; tandem runs SPLADE models of "
                         f"the BERT family ({', '.join(FAMILIES)}) with their masked-LM head")
    body, hidden, max_tokens = _bert(path, cfg, device, dtype, settings.kernels)
    raw = load_state_dict(path)
    family = FAMILIES[cfg["model_type"]]
    state = {}
    for ours, theirs in _MLM_KEYS.items():
        found = next((raw[k] for k in theirs if k in raw), None)
        if found is None:
            raise ValueError(f"weights in {str(path)!r} have no masked-LM head (missing {theirs[0]}): a SPLADE model "
                             "is saved as BertForMaskedLM")
        state[ours] = found
    tied = f"{family}.embeddings.word_embeddings.weight"
    decoder = raw.get("cls.predictions.decoder.weight", raw.get("lm_head.decoder.weight", raw.get(tied)))
    if decoder is None:
        raise ValueError(f"weights in {str(path)!r} have neither a decoder nor word embeddings to tie it to")
    state["decoder.weight"] = decoder
    head = _MaskedLMHead(hidden, decoder.shape[0], cfg.get("layer_norm_eps", 1e-12), cfg.get("hidden_act", "gelu"))
    head.load_state_dict(state)
    head = head.to(device=device, dtype=dtype).eval()

    def end(x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        bounds = cu.tolist()
        return torch.stack([torch.log1p(torch.relu(head(x[s:e]).float())).amax(0)
                            for s, e in zip(bounds[:-1], bounds[1:])])
    return Head(Stages(body.count, body.begin, body.run, end), decoder.shape[0], max_tokens)


def _sparse(encoder: "Encoder", vector: torch.Tensor, params: EmbedParams) -> list[tuple[int, float]]:
    """A sparse vector as its non-zero (vocabulary id, weight) pairs, id order."""
    ids = vector.nonzero().flatten()
    return list(zip(ids.tolist(), vector[ids].tolist()))


KIND = PoolingKind(PoolingTask.SPARSE, "sparse_embedder", "--sparse-embedder", "sparse embedder (SPLADE)", _sparse,
                   load_splade)
