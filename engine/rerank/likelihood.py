"""Query likelihood (UPR, Sachan et al. 2022): how likely the LLM finds the query after reading the document.

The pair is the document in a "write a question about this passage" prompt followed by the query; the runner
computes the log-probability of each query token (the LM head applied to the query span only) and the score is
exp(mean log-probability): the geometric-mean probability of a query token, in [0, 1] and monotone in the mean.
"""
from __future__ import annotations

import math

import torch

from engine.config import RerankMode, RerankParams
from engine.rerank.pairs import DOC_SLOT, PairTemplate, split_chat
from engine.rerank.scorer import PairScorer
from engine.request import Sequence

DEFAULT_INSTRUCTION = "Please write a question based on this passage."


class LikelihoodScorer(PairScorer):
    mode = RerankMode.LIKELIHOOD
    scores_last_position = False  # the query span's log-probabilities, which may arrive over several chunks

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def template(self, query: str, params: RerankParams) -> PairTemplate:
        user = f"Passage: {DOC_SLOT}\n{params.instruction or DEFAULT_INSTRUCTION}"
        prefix, suffix = split_chat(self.tokenizer, [{"role": "user", "content": user}], add_generation_prompt=True)
        query_ids = list(self.tokenizer(query, add_special_tokens=False).input_ids)
        return PairTemplate(prefix, suffix + query_ids, scored_suffix=len(query_ids))

    def document_ids(self, documents: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(documents, add_special_tokens=False).input_ids]

    def score(self, pairs: list[Sequence], last_hidden: torch.Tensor | None) -> list[float]:
        raise NotImplementedError("query likelihood scores a pair from its span: span_score")

    def pair_score(self, last: float | None, span: list[float]) -> float:
        return math.exp(sum(span) / len(span))
