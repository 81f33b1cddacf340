"""Dense: the embedder's cosine between the query and each document, and nothing else (a bi-encoder reranker).

The query and every document are embedder rows (KV-free, packed, run whole or layer by layer) of one request; no LLM
pair is made. The score is the cosine mapped to [0, 1], (1 + cos) / 2: monotone in the cosine, so the order is the
embedder's own ranking, and comparable across requests (unlike fusion's per-request scaling).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from engine.config import RerankMode, RerankParams
from engine.rerank.fusion import cosines
from engine.rerank.pairs import PairTemplate
from engine.rerank.scorer import PairPhase, PairScorer
from engine.request import Sequence


def unit_interval(cosine: float) -> float:
    """A cosine in [-1, 1] as a score in [0, 1]."""
    return (1.0 + cosine) / 2.0


class DenseScorer(PairScorer):
    mode = RerankMode.DENSE
    runs_on_llm = False
    embeds: ClassVar[bool] = True
    pair_phase: ClassVar[PairPhase] = PairPhase.NEVER

    def template(self, query: str, params: RerankParams) -> PairTemplate:
        raise NotImplementedError("the dense mode makes no pairs: its query and documents are embedder rows")

    def document_ids(self, documents: list[str]) -> list[list[int]]:
        raise NotImplementedError("the dense mode makes no pairs: its documents are tokenized by the embedder")

    def score(self, pairs: list[Sequence], last_hidden: torch.Tensor | None) -> list[float]:
        raise NotImplementedError("the dense mode scores from the embedder's vectors: request_scores")

    def request_scores(self, pair_scores: list[float], vectors: list[torch.Tensor] | None) -> list[float]:
        if vectors is None:
            raise ValueError("the dense mode needs the request's embeddings, and none were computed")
        return [unit_interval(c) for c in cosines(vectors)]
