"""What the scheduler moves around: sequences (rows of generations, rerank and embedding jobs) and their status."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.config import EmbedParams, RerankParams, SamplingParams

if TYPE_CHECKING:
    import torch


class Grammar(Protocol):
    """What a sequence's structured-output matcher does for the engine and the sampler (engine/structured.py's
    GrammarMatcher implements it; nothing here names the implementation)."""

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (no change) when the grammar does not allow it."""

    def is_terminated(self) -> bool:
        """The grammar can take no further token."""

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`."""


class SequenceStatus(enum.IntEnum):
    """Ordered: everything from FINISHED_STOPPED on is finished."""
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> "FinishReason | None":
        return _FINISH_REASONS.get(self)


class FinishReason(str, enum.Enum):
    """Why a completion (or a rerank job) ended; a str, so it still reads and compares as "stop" / "length" / ...
    Each door maps it once to its own vocabulary (the proto enum, OpenAI's finish_reason)."""
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
    SequenceStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class SeqKind(str, enum.Enum):
    """What a sequence (and the request it belongs to) is; a str, so it reads as "generate" / "rerank"."""
    GENERATE = "generate"
    RERANK = "rerank"  # prefill-only: scored when computed, no tokens sampled
    EMBED = "embed"  # one input text of an embedding request: an encoder row, prefill-only, no KV, run in stages

    @property
    def samples(self) -> bool:
        """Its rows decode, a sampled token a step (a generation's completions); every other kind's rows are
        prefill-only (scored or embedded when their last chunk or stage ran)."""
        return self is SeqKind.GENERATE

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class RowExec(enum.Enum):
    """How a row runs, apart from what its request is (SeqKind): the runner and the batch builder read this."""
    CAUSAL = "causal"  # through the LLM with KV blocks, in chunks: a generation's completion, an LLM-scored pair
    ENCODER = "encoder"  # through an encoder, no KV, in stages of layers: an embedding input, a cross-encoder pair


@dataclass(slots=True, eq=False)
class RerankPair:
    """What only a rerank pair has: its document's place in its job, and what it waits for. (The job itself is the
    engine's, found by the pair's request_id: rerank/ depends on this module, never the reverse.)"""
    index: int  # which document of the job
    wait_for: "Sequence | None" = None  # admitted only after this one computed its pair (it fills the shared prefix)
    token_type_ids: list[int] | None = None  # cross-encoder segment ids


@dataclass(slots=True, eq=False)
class Sequence:
    """One token stream the scheduler advances: num_computed_tokens catches up to num_tokens."""
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams | RerankParams | EmbedParams
    arrival: int  # admission order, for FIFO within a priority class
    arrival_time: float
    kind: SeqKind = SeqKind.GENERATE
    priority: int = 0  # lower runs first
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    waiting_since_step: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when it first rode in a step
    first_token_time: float | None = None
    generator: "torch.Generator | None" = None
    execution: RowExec = RowExec.CAUSAL  # ENCODER rows hold no KV blocks at all
    pair: RerankPair | None = None  # set exactly for rerank pairs
    # An encoder row's segment ids where its input is a text pair (a classified (text, text_pair)); None: all 0
    token_type_ids: list[int] | None = None
    # Prompt positions from here on get their token's log-probability computed (query likelihood, prompt_logprobs);
    # positions before it may come from the prefix cache, the ones after may not (a cached position has no logits).
    # What is computed accumulates on the request (Generation, RerankJob), not here.
    logprob_start: int | None = None
    # Top alternatives wanted per scored prompt position (SamplingParams.prompt_logprobs); None: none.
    num_prompt_logprobs: int | None = None
    index: int = 0  # which completion of its request (0..n-1); of an embedding row: which input
    # Completion 0 of the same request, for completions 1..n-1: they share its prompt's KV blocks.
    fork_of: "Sequence | None" = None
    grammar: Grammar | None = None  # structured output: masks the sampler, accepts each appended token
    # An encoder row (embedding input) runs its forward in `stages` (its embedder's layers) over one or more steps;
    # the scheduler counts the ones done. Its tokens count as computed once the last stage ran.
    stages: int = 1
    stages_done: int = 0
    # When its request's first result is due (a chat's first token, a pair's score, a row's vector), on the clock of
    # arrival_time: written once by Scheduler.add from what the admission policy said (None: no deadline, served in
    # arrival order after the work that has one). A generation's later tokens are due a pace apart from it.
    deadline: float | None = None

    @property
    def deadline_key(self) -> float:
        """The deadline as an order key (no deadline: after every deadline)."""
        return self.deadline if self.deadline is not None else math.inf

    @property
    def uses_kv(self) -> bool:
        """A causal row: it holds KV blocks (an encoder row holds none)."""
        return self.execution is RowExec.CAUSAL

    @property
    def samples(self) -> bool:
        """A generation's completion: once its prompt is computed it decodes, a sampled token a step (every other
        row is prefill-only: scored or embedded when its last chunk or stage ran)."""
        return self.kind.samples

    @property
    def wait_for(self) -> "Sequence | None":
        """The sequence whose prompt this one shares: the job's first pair, or completion 0 of the request."""
        return self.pair.wait_for if self.pair is not None else self.fork_of

    @property
    def blocked(self) -> bool:
        """Not admissible yet: `wait_for` is still computing the prompt this sequence will share. (A rerank pair
        that has computed its tokens is scored and finished in the same step, so for pairs this is "until the
        first pair finished".)"""
        first = self.wait_for
        return (first is not None and not first.status.finished
                and first.num_computed_tokens < first.num_prompt_tokens)

    @property
    def num_cacheable_tokens(self) -> int:
        """Leading tokens the prefix cache may serve: at least one token (and every scored position's predecessor)
        must be computed."""
        return (self.num_tokens if self.logprob_start is None else self.logprob_start) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def staged(self) -> bool:
        """An encoder row whose forward may be split across steps, a few stages (layers) at a time."""
        return self.stages > 1

    def ends_with(self, n: int, stages: tuple[int, int] | None) -> bool:
        """Whether a step that computes `n` of its tokens (an encoder row: runs `stages`) finishes this sequence's
        forward: its prompt's last chunk, or an encoder row's last stage (read before Scheduler.update counts them)."""
        if stages is not None:
            return stages[1] == self.stages
        return self.num_computed_tokens + n == self.num_tokens

    def stage_tokens(self, k: int) -> int:
        """What this row's next k stages cost in a step's token budget: its tokens times their share of its forward
        (each stage's share rounded so that all its stages cost exactly its tokens)."""
        return self._tokens_to(self.stages_done + k) - self._tokens_to(self.stages_done)

    def stages_within(self, tokens: int) -> int:
        """The most of this row's remaining stages whose stage_tokens fit in `tokens` (0: not even one)."""
        reach = (tokens + self._tokens_to(self.stages_done)) * self.stages // self.num_tokens
        return max(0, min(self.stages, reach) - self.stages_done)

    def _tokens_to(self, stage: int) -> int:
        """The budget tokens of this row's stages 0..stage-1."""
        return -(-self.num_tokens * stage // self.stages)
