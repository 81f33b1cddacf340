"""What one step computes: the plain record the scheduler hands the model runner and the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import RowExec, Sequence
from engine.step_time import RERANK_KINDS, TokenKind, work_kind


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
    """What one step computes: for each sequence, its next num_new_tokens tokens. Per kind of work (TokenKind, as
    the step-time model prices it), the tokens the step computes (`tokens`), the rows that ride in it (`rows`: a
    chunked pair or a staged row counts in each of its steps) and, of those, the ones whose last chunk or stage runs
    in it (`rows_done`: scored, embedded); decodes are counted apart."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decode_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens that newly admitted sequences took from the prefix cache
    tokens: dict[TokenKind, int] = field(default_factory=dict)  # of a row that runs k of its N stages, k / N of its tokens
    rows: dict[TokenKind, int] = field(default_factory=dict)
    rows_done: dict[TokenKind, int] = field(default_factory=dict)
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
        if n == 1 and seq.samples and seq.num_output_tokens > 0 and seq.num_computed_tokens == seq.num_tokens - 1:
            self.num_decode_tokens += 1
            self.num_decode_context_tokens += seq.num_tokens
            if self.min_decode_priority is None or seq.priority < self.min_decode_priority:
                self.min_decode_priority = seq.priority
            self.decode_request_ids.append(seq.request_id)
            return
        kind = work_kind(seq)
        self.tokens[kind] = self.tokens.get(kind, 0) + n
        self.rows[kind] = self.rows.get(kind, 0) + 1
        if seq.ends_with(n, stages):
            self.rows_done[kind] = self.rows_done.get(kind, 0) + 1

    # Read-only views by the old names (the scheduler's and admission's tests read them)
    @property
    def num_prefill_tokens(self) -> int:
        return self.tokens.get(TokenKind.PREFILL, 0)

    @property
    def num_rerank_tokens(self) -> int:
        return sum(self.tokens.get(k, 0) for k in RERANK_KINDS)

    @property
    def num_cross_encoder_tokens(self) -> int:
        return self.tokens.get(TokenKind.CROSS_ENCODER, 0)

    @property
    def num_rerank_pairs(self) -> int:
        return sum(self.rows.get(k, 0) for k in RERANK_KINDS)

    @property
    def num_rerank_pairs_scored(self) -> int:
        return sum(self.rows_done.get(k, 0) for k in RERANK_KINDS)

    @property
    def num_embed_rows(self) -> int:
        return self.rows.get(TokenKind.EMBED, 0)

    @property
    def num_embed_tokens(self) -> int:
        return self.tokens.get(TokenKind.EMBED, 0)

    @property
    def num_embed_rows_done(self) -> int:
        return self.rows_done.get(TokenKind.EMBED, 0)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)
