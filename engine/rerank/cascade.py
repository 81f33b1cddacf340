"""Cascade: the embedder's cosine ranks every document, then query likelihood re-scores the dense top k only.

A cascade request first runs its query and documents through the embedder (KV-free rows, as the dense mode does);
once they have run, the k documents with the highest cosine (ties: the earlier document) get their query-likelihood
pairs queued (PairPhase.AFTER_ROWS); the other documents never reach the LLM. The k are then fused exactly as the
fusion mode fuses a whole request (fusion.convex: each signal min-max scaled over the k, weight FUSION_WEIGHT) and
placed above the rest, which keep the dense order:

* the k re-scored documents: 0.5 + 0.5 * fused, in [0.5, 1];
* the others: 0.499 * (1 + cos) / 2, in [0, 0.499], monotone in their cosine.

With k >= the number of documents every document is re-scored and the order is the fusion mode's. LLM work per
request is k pairs instead of one per document.
"""
from __future__ import annotations

from typing import ClassVar, Sequence

import torch

from engine.config import RerankMode
from engine.rerank.dense import unit_interval
from engine.rerank.fusion import FUSION_WEIGHT, convex, cosines
from engine.rerank.likelihood import LikelihoodScorer
from engine.rerank.scorer import PairPhase

DEFAULT_CASCADE_K = 8
BELOW = 0.499  # the scale of the documents not re-scored: strictly under the re-scored ones' 0.5


def top_k(dense: Sequence[float], k: int) -> list[int]:
    """The indices of the k highest scores, highest first (ties: the earlier index)."""
    return sorted(range(len(dense)), key=lambda i: (-dense[i], i))[:k]


def cascade(likelihood: Sequence[float | None], dense: Sequence[float], k: int,
            weight: float = FUSION_WEIGHT) -> list[float]:
    """The cascade's scores: `likelihood` is read only at the dense top k (None elsewhere is fine), `dense` is every
    document's cosine."""
    top = top_k(dense, k)
    fused = convex([likelihood[i] for i in top], [dense[i] for i in top], weight)
    out = [BELOW * unit_interval(d) for d in dense]
    for i, f in zip(top, fused):
        out[i] = 0.5 + 0.5 * f
    return out


class CascadeScorer(LikelihoodScorer):
    mode = RerankMode.CASCADE
    embeds: ClassVar[bool] = True
    pair_phase: ClassVar[PairPhase] = PairPhase.AFTER_ROWS

    def __init__(self, tokenizer, k: int = DEFAULT_CASCADE_K) -> None:
        super().__init__(tokenizer)
        self.k = k

    def chosen(self, vectors: list[torch.Tensor]) -> list[int]:
        return top_k(cosines(vectors), self.k)

    def request_scores(self, pair_scores: list[float | None], vectors: list[torch.Tensor] | None) -> list[float]:
        if vectors is None:
            raise ValueError("the cascade mode needs the request's embeddings, and none were computed")
        return cascade(pair_scores, cosines(vectors), self.k)
