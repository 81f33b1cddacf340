"""The one protocol every kind of work implements (Generation, RerankJob, EmbedJob), and what the engine hands it.

The engine knows a request only through `Job`: the rows it queued (`sequences`), applying one row's result of a step, whether it
finished, and the outputs that end it early. How a row runs (RowExec: causal with KV chunks, encoder in stages) is
the row's, not the job's; what a row's result means (a sampled token, a pair's score, a vector) is the job's.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.outputs import Logprobs, StepOutput
from engine.request import FinishReason, Sequence, SequenceStatus

if TYPE_CHECKING:
    import torch

    from engine.config import PoolingTask
    from engine.embed.embedder import Embedder
    from engine.rerank.scorer import PairScorer


@dataclass(slots=True)
class RowResult:
    """What one step computed for one row (its entries of the runner's output): most are None for most rows."""
    num_new_tokens: int  # the tokens of the row this step computed (an encoder row: what its stages cost)
    stages: tuple[int, int] | None = None  # the stages an encoder row ran (start, stop); None for a causal row
    token: int | None = None  # a sampled token (a completion whose prompt is computed)
    logprobs: Logprobs | None = None  # that token's log-probability and top alternatives (SamplingParams.logprobs)
    score: float | None = None  # what a pair's last position gave (judge, cross-encoder)
    span: list[float] | None = None  # log-probabilities of the prompt positions this chunk predicts
    top: list[Logprobs] | None = None  # their top alternatives (prompt_logprobs)
    vector: "torch.Tensor | None" = None  # an encoder row's pooled vector, once its last stage ran


@dataclass(slots=True)
class JobContext:
    """What the jobs read while applying results: the engine's parts, passed in, never reached for."""
    scorer: "PairScorer"  # a pair's score from its results, a request's from its pairs' (and vectors)
    eos_token_ids: Collection[int]
    max_model_len: int
    # PoolingTask -> the Embedder that finishes that task's rows (the embedder's EMBED, a classifier, ...)
    poolers: "dict[PoolingTask, Embedder]" = field(default_factory=dict)


@dataclass(slots=True)
class StepEffects:
    """What applying one step's results did, across every job: outputs to hand out now, rows to let go (the
    scheduler's update takes them out) and rows to queue (a cascade's chosen pairs)."""
    now: float  # time.monotonic() when the step's results are applied
    outputs: list[StepOutput] = field(default_factory=list)
    finished: dict[Sequence, SequenceStatus] = field(default_factory=dict)
    queued: list[Sequence] = field(default_factory=list)


class Job(Protocol):
    """One request in flight, whatever its kind."""
    request_id: str

    @property
    def finished(self) -> bool:
        """Its last output went out in a step (not set by an abort or a failed step: the engine drops those)."""

    @property
    def sequences(self) -> list[Sequence]:
        """Its rows: every one it has queued so far, finished ones included."""

    def apply(self, row: Sequence, result: RowResult, effects: StepEffects, ctx: JobContext) -> None:
        """Take `row`'s result of this step (a running row of this job, not yet let go): accumulate it, put the
        outputs it makes, the rows it ends and the rows it queues into `effects`."""

    def final_outputs(self, reason: FinishReason, error: str | None = None) -> list[StepOutput]:
        """The outputs that end it before its work is done (abort, a failed step): the last has finished set."""


def put_span(acc: list, seq: Sequence, span: list) -> None:
    """Put the log-probabilities (or top alternatives) a row's chunk computed for positions logprob_start.. in their
    place in `acc`, the request's: a chunk that starts over (a preempted sequence recomputing) replaces the rest."""
    first = seq.logprob_start - 1  # the position whose hidden state predicts the first scored token
    acc[max(seq.num_computed_tokens - first, 0):] = span


def queue_time(rows: list[Sequence], arrival_time: float) -> float | None:
    """Arrival until the first of `rows` rode in a step (None: none has)."""
    started = [r.first_scheduled_time for r in rows if r.first_scheduled_time is not None]
    return min(started) - arrival_time if started else None
