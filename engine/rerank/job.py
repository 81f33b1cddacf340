"""One Rerank request in flight: its documents, one pair sequence per document, scores as they arrive."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import RerankParams
from engine.request import Sequence

if TYPE_CHECKING:
    import torch


@dataclass(slots=True, eq=False)
class RerankJob:
    request_id: str
    query: str
    documents: list[str]
    params: RerankParams
    arrival_time: float
    pairs: list[Sequence] = field(default_factory=list)
    scores: list[float | None] = field(default_factory=list)
    # Per document: its scored span's log-probabilities as its chunks compute them (query likelihood).
    span_logprobs: list[list[float]] = field(default_factory=list)
    remaining: int = 0
    document_tokens: list[int] = field(default_factory=list)  # per document: its tokens the pair scores
    truncated: list[bool] = field(default_factory=list)  # per document: cut at its end to fit the pair limit
    # A mode that embeds (fusion): one embedder row for the query, then one per document, and their pooled vectors
    # as the rows run (engine.py fills them); empty otherwise.
    rows: list[Sequence] = field(default_factory=list)
    vectors: list[torch.Tensor | None] = field(default_factory=list)
    # A mode whose pairs wait for the embedder rows (the cascade, PairPhase.AFTER_ROWS): every document's pair, made
    # with the request (so each document is tokenized once, off the engine thread) and not queued; release() moves
    # the chosen ones to `pairs` once the rows have run.
    held: list[Sequence] = field(default_factory=list)
    wait_for_first: bool = False  # later pairs wait for the first one queued (it fills their shared prefix)
    # Long documents in windows: per unit (pair or embedder row after the query's), the document it scores; empty when
    # every document is one unit. `scores` and `span_logprobs` are per unit until pooled (pooled_scores).
    units: list[int] = field(default_factory=list)
    windows: list[int] = field(default_factory=list)  # per document: the windows (units) it was scored as

    def pooled_scores(self, unit_scores: list[float]) -> list[float]:
        """Per document: the best of its windows' scores (max pooling); the scores as they are without windows."""
        if not self.units:
            return unit_scores
        best = [float("-inf")] * len(self.documents)
        for doc, score in zip(self.units, unit_scores):
            best[doc] = max(best[doc], score)
        return best

    def release(self, indices: list[int]) -> list[Sequence]:
        """Queue the held pairs of documents `indices` and drop the rest; returns the queued ones, in document order.
        The first of them fills the shared prefix the others wait for: it must be the one the scheduler's queue
        (priority, then arrival: document order) offers first, or the queue's head would wait for a pair behind it
        forever."""
        pairs = [self.held[i] for i in sorted(indices)]
        for seq in pairs:
            seq.pair.wait_for = pairs[0] if self.wait_for_first and seq is not pairs[0] else None
        self.held = []
        self.pairs.extend(pairs)
        self.remaining += len(pairs)
        return pairs

    @property
    def prompt_tokens(self) -> int:
        """Every token the request computes: its pairs' and its embedder rows'."""
        return sum(p.num_prompt_tokens for p in self.pairs) + sum(r.num_prompt_tokens for r in self.rows)

    @property
    def sequences(self) -> list[Sequence]:
        return self.pairs + self.rows

    @property
    def cached_tokens(self) -> int:
        return sum(p.num_cached_tokens for p in self.pairs)
