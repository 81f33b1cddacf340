"""Fusion: query likelihood and the embedder's cosine, combined per request (Zhuang et al., EMNLP Findings 2023:
fusing a query-likelihood reranker with a first-stage score gains nDCG).

A fusion request runs its pairs through the LLM exactly as the likelihood mode does and, in the same scheduler
steps, its query and documents through the embedder as KV-free rows. When the last of them has run, each signal is
min-max scaled over the request's documents and the two are averaged with fixed weights (FUSION_WEIGHT, measured on
the project's corpora in bench/rerank_quality.py and written down in docs/benchmarks.md; never tuned per query). A
fused score therefore orders the documents of one request; it is not comparable across requests.
"""
from __future__ import annotations

from typing import ClassVar, Sequence

import torch

from engine.config import RerankMode
from engine.rerank.likelihood import LikelihoodScorer

FUSION_WEIGHT = 0.5  # the likelihood's share; the cosine's is 1 - FUSION_WEIGHT
RRF_K = 60  # reciprocal rank fusion's constant (Cormack et al. 2009), for the benchmark's comparison


def minmax(values: Sequence[float]) -> list[float]:
    """Values scaled to [0, 1] over the request; all equal (one document, say): 0.5 each, so the other signal
    decides."""
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [0.5] * len(values)
    return [(v - lo) / (hi - lo) for v in values]


def convex(likelihood: Sequence[float], dense: Sequence[float], weight: float = FUSION_WEIGHT) -> list[float]:
    """weight * minmax(likelihood) + (1 - weight) * minmax(dense), per document."""
    return [weight * a + (1 - weight) * b for a, b in zip(minmax(likelihood), minmax(dense))]


def rrf(*rankings: Sequence[float], k: int = RRF_K) -> list[float]:
    """Reciprocal rank fusion of score lists: sum over lists of 1 / (k + rank), rank 1 the highest score (ties: the
    earlier document ranks first)."""
    out = [0.0] * len(rankings[0])
    for scores in rankings:
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        for rank, i in enumerate(order, 1):
            out[i] += 1 / (k + rank)
    return out


def cosines(vectors: Sequence[torch.Tensor]) -> list[float]:
    """The cosine of the query's vector (the first) with each document's (the rest)."""
    unit = torch.nn.functional.normalize(torch.stack(list(vectors)).float(), dim=-1)
    return (unit[1:] @ unit[0]).tolist()


class FusionScorer(LikelihoodScorer):
    mode = RerankMode.FUSION
    embeds: ClassVar[bool] = True

    def request_scores(self, pair_scores: list[float], vectors: list[torch.Tensor] | None) -> list[float]:
        if vectors is None:
            raise ValueError("the fusion mode needs the request's embeddings, and none were computed")
        return convex(pair_scores, cosines(vectors))
