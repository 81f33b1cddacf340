"""One Rerank request in flight: its documents, one pair sequence per document, scores as they arrive."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import RerankParams
from engine.jobs import JobContext, RowResult, StepEffects, put_span, queue_time
from engine.outputs import RerankOutput
from engine.request import FinishReason, Sequence, SequenceStatus

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
    # Long documents in windows: per pair, the document it scores (`scores` and `span_logprobs` are per pair), and per
    # embedder row after the query's, the document it embeds (`vectors` are per row); empty: one per document.
    pair_units: list[int] = field(default_factory=list)
    row_units: list[int] = field(default_factory=list)
    windows: list[int] = field(default_factory=list)  # per document: the windows it was scored as
    finished: bool = False  # its output went out (every pair and row ran)

    # ---- the Job protocol ----------------------------------------------------------------------------------------

    def apply(self, row: Sequence, result: RowResult, effects: StepEffects, ctx: JobContext) -> None:
        """A pair: its span's log-probabilities so far, and its score once its last chunk (stage) ran. An embedder
        row (a mode that embeds): its vector once its last stage ran. When the last of them is in: the held pairs the
        scorer now chooses are queued (the cascade's dense top k), or else the job ends with its scores."""
        if row.pair is None:  # an embedder row: the query's, or a document's
            if result.vector is None:
                return  # some of the row's stages ran: the rest come in later steps
            self.vectors[row.index] = result.vector
        else:
            index = row.pair.index
            if result.span:
                put_span(self.span_logprobs[index], row, result.span)
            if not row.ends_with(result.num_new_tokens, result.stages):
                return  # a chunk (or some stages) of a pair: scored when its last one runs
            self.scores[index] = ctx.scorer.pair_score(result.score, self.span_logprobs[index])
        effects.finished[row] = SequenceStatus.FINISHED_STOPPED
        self.remaining -= 1
        if self.remaining:
            return
        if self.held:
            effects.queued.extend(self.release(ctx.scorer.chosen(self.pooled_vectors())))
            return
        self.scores = ctx.scorer.request_scores(self.pooled_scores(), self.pooled_vectors() if self.rows else None)
        self.finished = True
        effects.outputs.extend(self.final_outputs(FinishReason.STOP))

    def final_outputs(self, reason: FinishReason, error: str | None = None) -> list[RerankOutput]:
        """Its one output: the scores (per document, input order) when it finished with "stop"."""
        done = reason is FinishReason.STOP
        return [RerankOutput(
            self.request_id, finished=True, finish_reason=reason, error=error,
            scores=list(self.scores) if done else None, document_tokens=list(self.document_tokens) if done else None,
            truncated=list(self.truncated) if done else None, windows=list(self.windows) if done else None,
            embedder_scored=self.embedder_scored if done else 0,
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens, arrival_time=self.arrival_time,
            queue_time_s=queue_time(self.sequences, self.arrival_time))]

    def pooled_scores(self) -> list[float | None]:
        """Per document: the best of its pairs' scores (max pooling)."""
        if not self.pair_units:
            return self.scores
        best: list[float | None] = [None] * len(self.documents)
        for doc, score in zip(self.pair_units, self.scores):
            if score is not None:
                best[doc] = score if best[doc] is None else max(best[doc], score)
        return best

    def pooled_vectors(self) -> list[torch.Tensor]:
        """The query's vector, then per document its window's vector nearest the query (highest cosine: a
        window-pooled cosine, max pooling, for every mode that reads the cosine)."""
        if not self.row_units:
            return self.vectors
        import torch

        query, rows = self.vectors[0], self.vectors[1:]
        unit = torch.nn.functional.normalize(torch.stack(list(self.vectors)).float(), dim=-1)
        cos = (unit[1:] @ unit[0]).tolist()
        best: list[int | None] = [None] * len(self.documents)
        for r, doc in enumerate(self.row_units):
            if best[doc] is None or cos[r] > cos[best[doc]]:
                best[doc] = r
        return [query] + [rows[r] for r in best]

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
    def embedder_scored(self) -> int:
        """Documents whose score is the embedder's cosine alone: those no pair (of any window) scored."""
        if not self.rows:
            return 0
        paired = {self.pair_units[p.pair.index] if self.pair_units else p.pair.index for p in self.pairs}
        return len(self.documents) - len(paired)

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
