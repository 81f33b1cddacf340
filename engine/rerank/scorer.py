"""The one interface every rerank mode implements: pair tokens in, one relevance score per pair out."""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from engine.config import RerankMode, RerankParams
from engine.rerank.pairs import PairTemplate, PairTokens

if TYPE_CHECKING:
    import torch

    from engine.models.stages import Finish, StagedForward, StageResult, StageWork
    from engine.request import Sequence


class PairPhase(str, enum.Enum):
    """When a request's documents get the pairs a scorer scores."""
    AT_ONCE = "at-once"  # every document's pair is queued with the request
    NEVER = "never"  # no pairs at all: the embedder rows alone score (the dense mode)
    # every document's pair is made with the request, but only those chosen() once the embedder rows have run are
    # queued (the cascade: the dense top k)
    AFTER_ROWS = "after-rows"


class PairScorer(ABC):
    """A rerank mode, chosen once when the engine is built and handed to the model runner."""
    mode: ClassVar[RerankMode]
    # True: pairs ride the LLM's forward in the scheduler's ragged batch and hold KV blocks while they run.
    # False: the scorer runs its own model over the pairs (a cross-encoder), no KV at all.
    runs_on_llm: ClassVar[bool] = True
    # True: score() reads the final hidden state at each pair's last position (judge) or runs its own model
    # (cross-encoder), in the runner. False: the score comes from the log-probabilities of the pair's scored span,
    # which a pair prefilled in chunks gets over several steps. Either way pair_score() makes the pair's score.
    scores_last_position: ClassVar[bool] = True
    max_length: int | None = None  # the scorer's own cap on a pair's tokens, if it has one
    # True: the request's query and documents also run through the embedder (KV-free rows in the same steps as the
    # pairs) and request_scores() combines both signals (the fusion mode).
    embeds: ClassVar[bool] = False
    pair_phase: ClassVar[PairPhase] = PairPhase.AT_ONCE

    def chosen(self, vectors: list[torch.Tensor]) -> list[int]:
        """PairPhase.AFTER_ROWS: the documents whose pairs run, from the embedder's vectors (the query's first, then
        each document's)."""
        raise NotImplementedError(f"the {self.mode} mode queues its pairs with the request")

    @abstractmethod
    def template(self, query: str, params: RerankParams) -> PairTemplate:
        """The tokens around every document of this query."""

    @abstractmethod
    def document_ids(self, documents: list[str]) -> list[list[int]]:
        """Each document's tokens, as they stand inside a pair."""

    @abstractmethod
    def score(self, pairs: list[Sequence], last_hidden: torch.Tensor | None) -> list[float]:
        """One score in [0, 1] per finished pair. `last_hidden` is the LLM's final hidden state at each pair's last
        position (None when the scorer runs its own model)."""

    @property
    def stages(self) -> int:
        """Stages the scorer's own model runs a pair in, a few a step (1: whole; LLM-scored pairs are chunked by
        tokens instead)."""
        return 1

    def score_stages(self, pairs: list[Sequence], stages: list[tuple[int, int]], states: list[torch.Tensor | None]
                     ) -> list[StageResult]:
        """Scorers with their own model: each pair's stages start..stop-1 this step, from the states its earlier
        stages made (`states`, None for a pair at its first stage); the score of each pair whose last stage ran as
        its output, the new states of the others (the caller keeps them: engine/staged_states.py)."""
        return [StageResult(score) for score in self.score(pairs, None)]

    @property
    def staged(self) -> StagedForward | None:
        """The staged forward of the scorer's own model, when it has one (a cross-encoder); an embedder of the same
        encoder shares it, and then a step runs both kinds of rows in one forward (`stage_part`)."""
        return None

    def stage_part(self, pairs: list[Sequence], stages: list[tuple[int, int]], states: list[torch.Tensor | None]
                   ) -> tuple[list[StageWork], Finish]:
        """The pairs' stages this step (from `states`, as in score_stages) as a part of a shared forward (StagedForward.run_parts); only scorers
        whose `staged` is not None have one."""
        raise NotImplementedError(f"the {self.mode} mode has no staged forward of its own")

    def pair_score(self, last: float | None, span: list[float]) -> float:
        """A pair's score once its last chunk has run, in every mode (the engine asks here and nowhere else): from
        `last`, what score() gave at its last position (scores_last_position), or from `span`, its scored span's
        log-probabilities over all its chunks."""
        if last is None:
            raise ValueError(f"the {self.mode} mode scores at a pair's last position, and none was scored")
        return last

    def request_scores(self, pair_scores: list[float], vectors: list[torch.Tensor] | None) -> list[float]:
        """The request's scores once every pair (and, when `embeds`, every embedder row: the query's vector first,
        then each document's) has run; the pairs' own scores in every mode but fusion."""
        return pair_scores

    def pairs(self, query: str, documents: list[str], params: RerankParams, limit: int, limit_by: str = "",
              max_windows: int = 1, overlap: int = 0) -> tuple[list[PairTokens], int]:
        """Every pair within `limit` tokens (set by `limit_by`, named in errors): one per document, or one per window
        of a document longer than that (up to `max_windows`, `overlap` tokens shared); and the length of the prefix
        they share."""
        if not documents:
            return [], 0
        template = self.template(query, params)
        ids = self.document_ids(documents)
        if params.max_document_tokens is not None:
            ids = [d[:params.max_document_tokens] for d in ids]
        return template.fit(ids, limit, params.truncate, limit_by, max_windows, overlap), len(template.prefix)
