"""What one step computes: the plain record the scheduler hands the model runner and the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import RowExec, Sequence
from engine.step_time import TokenKind, work_kind


@dataclass(frozen=True, slots=True)
class Owed:
    """What a latency policy owed one kind of waiting work in a step: `seconds` of the step's time (its share), and
    `unit_s`, what that kind's least unit costs beside the decodes (a kind may save up to that much, no more). The
    policy hands it out in its Quota, the step carries it, and the policy's ledger settles it when it observes the
    step's record (engine/admission.py)."""
    kind: TokenKind
    seconds: float
    unit_s: float


@dataclass(slots=True)
class Batch:
    """What one step computes: for each sequence, its next num_new_tokens tokens."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens that newly admitted sequences took from the prefix cache
    num_rerank_pairs: int = 0  # pairs with tokens in this step (a chunked pair counts in each of its steps)
    num_rerank_pairs_scored: int = 0  # of those, pairs whose last chunk runs in this step (scored by it)
    num_rerank_tokens: int = 0
    num_cross_encoder_tokens: int = 0  # rerank tokens that run in the cross-encoder's forward, not the LLM's
    num_embed_rows: int = 0  # embedding inputs in this step (whole, or some of their stages: the embedder's forward)
    num_embed_tokens: int = 0  # of a row that runs k of its N stages, k / N of its tokens (Sequence.stage_tokens)
    num_embed_rows_done: int = 0  # of those rows, the ones whose last stage runs in this step
    num_decode_context_tokens: int = 0  # context the decode rows attend to (their sequence lengths, summed)
    min_decode_priority: int | None = None  # the most urgent decode's priority (lower runs first)
    preempted: list[Sequence] = field(default_factory=list)
    budget: int = 0  # the token budget the scheduler planned this step under
    decode_request_ids: list[str] = field(default_factory=list)
    # Per sequence: the stages (start, stop) an encoder row (embedding input, cross-encoder pair) runs in this step;
    # None for every other sequence.
    stages: list[tuple[int, int] | None] = field(default_factory=list)
    # What the admission policy's quota said of this step (engine/admission.py Quota)
    target_s: float | None = None
    limit_s: float | None = None
    planned: bool = False
    owed: tuple[Owed, ...] = ()
    _members: set[int] = field(default_factory=set, repr=False)  # id() of each sequence add() put in `seqs`

    def __contains__(self, seq: Sequence) -> bool:
        return id(seq) in self._members

    def add(self, seq: Sequence, n: int, stages: tuple[int, int] | None = None) -> None:
        """`n` tokens of `seq`; an encoder row gives the stages it runs (n is then what they cost; default: the rest)."""
        self.seqs.append(seq)
        self._members.add(id(seq))
        self.num_new_tokens.append(n)
        if stages is None and seq.execution is RowExec.ENCODER:
            stages = (seq.stages_done, seq.stages)  # the rest of its forward
        self.stages.append(stages)
        kind = work_kind(seq)
        if kind is TokenKind.EMBED:
            self.num_embed_rows += 1
            self.num_embed_tokens += n
            if stages[1] == seq.stages:
                self.num_embed_rows_done += 1
        elif kind is not TokenKind.PREFILL:  # a rerank pair, in the LLM or in the cross-encoder
            self.num_rerank_pairs += 1
            if seq.ends_with(n, stages):
                self.num_rerank_pairs_scored += 1
            self.num_rerank_tokens += n
            if kind is TokenKind.CROSS_ENCODER:
                self.num_cross_encoder_tokens += n
        elif n == 1 and seq.num_output_tokens > 0 and seq.num_computed_tokens == seq.num_tokens - 1:
            self.num_decode_tokens += 1
            self.num_decode_context_tokens += seq.num_tokens
            if self.min_decode_priority is None or seq.priority < self.min_decode_priority:
                self.min_decode_priority = seq.priority
            self.decode_request_ids.append(seq.request_id)
        else:
            self.num_prefill_tokens += n

    @property
    def num_scoring_tokens(self) -> int:
        """Tokens from the scoring queue (rerank pairs and embedding rows): what its admissions gave this step."""
        return self.num_rerank_tokens + self.num_embed_tokens

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)
