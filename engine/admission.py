"""Admission policies: how the token budget and seats a step has left after decodes and prefill chunks are split
between waiting prompts and waiting rerank pairs. The scheduler is given one; it never hard-wires a split."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine.batch import Batch
from engine.cadence import CadenceGuard
from engine.config import EngineConfig
from engine.request import SeqKind
from engine.step_time import OnlineStepTime, StepShape, TokenKind

if TYPE_CHECKING:
    from engine.outputs import StepRecord
    from engine.request import Sequence
    from engine.step_time import LinearStepTime


class AdmissionQueues(Protocol):
    """The scheduler's side of one step's admissions: its two wait queues (rerank pairs part-way through count as
    the rerank queue's) and the batch they admit into. Each admit call takes from the head of its queue (priority,
    then FIFO) while `max_tokens` tokens and `max_seats` new seats (None: no limit) last; returns tokens admitted."""

    def admit_generation(self, max_tokens: int, max_seats: int | None) -> int: ...

    def admit_rerank(self, max_tokens: int, max_seats: int | None, kind: TokenKind | None = None) -> int: ...

    def generation_head(self) -> "Sequence | None": ...

    def rerank_head(self, kind: TokenKind | None = None) -> "Sequence | None": ...


@dataclass(slots=True)
class AdmissionStep:
    """What a policy sees of one step, and the queues it admits from. admit_generation / admit_rerank lower
    `budget` by what they admitted."""
    batch: Batch  # decodes and prefill chunks already scheduled this step
    budget: int  # tokens left in this step
    free_seats: int  # sequences that may still join the running set
    generation_waiting: int
    rerank_waiting: int
    rerank_head_tokens: int  # tokens of the rerank pair that would be admitted next (0: none)
    queues: AdmissionQueues = field(repr=False)

    def generation_head(self) -> "Sequence | None":
        """The prompt admit_generation would take next (it changes as admissions pop the queue)."""
        return self.queues.generation_head()

    def rerank_head(self, kind: TokenKind | None = None) -> "Sequence | None":
        """The pair (or embedding row) admit_rerank would take next; of that kind only, when given."""
        return self.queues.rerank_head(kind)

    def admit_generation(self, max_tokens: int | None = None, max_seats: int | None = None) -> int:
        limit = self.budget if max_tokens is None else min(max_tokens, self.budget)
        used = self.queues.admit_generation(limit, max_seats) if limit > 0 else 0
        self.budget -= used
        return used

    def admit_rerank(self, max_tokens: int | None = None, max_seats: int | None = None,
                     kind: TokenKind | None = None) -> int:
        """Scoring work (rerank pairs, embedding rows), most urgent first; `kind`: only work of that kind
        (`scoring_kind`), so a policy that priced its tokens gets no others."""
        limit = self.budget if max_tokens is None else min(max_tokens, self.budget)
        used = self.queues.admit_rerank(limit, max_seats, kind) if limit > 0 else 0
        self.budget -= used
        return used


@runtime_checkable
class AdmissionPolicy(Protocol):
    """How a step's leftover budget and seats go to prompts and rerank pairs. The scheduler calls `prefill_budget`
    then `admit` each step; the engine calls `predict` and, when `observes_steps`, `observe`. A policy need only
    write `admit`: subclassing this protocol gives the rest their defaults."""
    observes_steps: bool = False  # True: the engine builds a StepRecord every step and hands it to observe()

    def admit(self, step: AdmissionStep) -> None:
        """Admit waiting work into `step.batch` through step.admit_generation / step.admit_rerank."""
        raise NotImplementedError

    def prefill_budget(self, step: AdmissionStep, continuing: list["Sequence"]) -> int:
        """Tokens the prompts already running (`continuing`, chunked prefill) may take next, of the `step.budget`
        the decodes in `step.batch` left; called before admit (which then sees what they took)."""
        return step.budget

    def predict(self, batch: Batch) -> float | None:
        """Predicted seconds of the step that runs `batch` (None: this policy has no step-time model)."""
        return None

    @property
    def target_s(self) -> float | None:
        """The step time this policy keeps decodes under (None: none)."""
        return None

    def limit_s(self) -> float | None:
        """The predicted step time this policy plans a step's admissions under (None: it plans none)."""
        return None

    def observe(self, record: "StepRecord") -> None:
        """What the step the engine just ran did and took (called when observes_steps)."""


@dataclass(slots=True)
class ShareAdmission(AdmissionPolicy):
    """A fixed share: while generation needs the step too (prompts wait, or decodes ride in it, whose time per
    output token grows with every rerank token added), rerank pairs get `rerank_share` of what is left, of the
    token budget and of the free seats, and always room for one pair, so a long pair cannot starve. The seat
    share lets a new prompt start at once beside a rerank flood; pairs are scored (and leave) in the step that
    admits them, so it never holds back a pair already running. With no decodes in the step, pairs also take
    whatever the prompts left."""
    rerank_share: float = 0.5

    def admit(self, step: AdmissionStep) -> None:
        if step.rerank_waiting and (step.generation_waiting or step.batch.num_decode_tokens):
            cap = max(int(step.budget * self.rerank_share), step.rerank_head_tokens)
            step.admit_rerank(cap, max(1, int(step.free_seats * self.rerank_share)))
            step.admit_generation()
            if not step.batch.num_decode_tokens:
                step.admit_rerank()
            return
        step.admit_generation()
        step.admit_rerank()


@dataclass(slots=True)
class LatencyAdmission(AdmissionPolicy):
    """A latency objective: while decodes ride in a step, admit the most prompt and rerank tokens whose predicted
    step time (`model`, fitted online by default) keeps the decodes' time per output token at or under
    `tpot_target_s`, planning with the model's own error margin (predicted x (1 + margin) <= target).

    * No decodes in the step: nothing to protect, `fallback` (ShareAdmission: the whole budget) decides.
    * Reranking makes progress every step, and a prompt too (floors, on top of what the headroom admits):
      - LLM-scored pairs (likelihood, judge) are prefilled in chunks like prompts, so while pairs wait every step
        computes at least the rerank tokens whose predicted cost is `rerank_floor` x the target (at least one token;
        about 10% of T: a step whose decodes alone are under T stays under 1.1 T with the floor);
      - an encoder row (cross-encoder pair, embedding input) cannot be split by tokens but runs a stage (one layer)
        at a time when a step has no room for it whole: one stage rides in every step whose predicted time stays
        within the target with it (the margin aside), and after `max_stage_wait_steps` steps of its kind without
        room, one stage whatever it costs (so a kind the fitted model has never seen beside decodes, priced at the
        slow prior, gets measured); a single-stage row (a decoder embedder's) waits `max_pair_wait_steps`, then rides
        whole;
      - at least `min_prefill_tokens` of prompt (chunked) while prompts wait.
      What no admission can fix: when the decodes alone take longer than the target (too many of them for this
      device), only the floors ride beside them and every such step is over the target.
    * Priority: work whose declared priority is strictly better (lower) than every decode in the step is not held
      to the objective; it is admitted as if no decode ran (it may push those decodes past the target). Otherwise
      the more urgent of the two queue heads fills the headroom first; at equal priority pairs get `rerank_share`
      of the headroom (and of the free seats) first, prompts the rest, then pairs whatever prompts left. Inside the
      scoring share, the kinds waiting at the most urgent priority (LLM-scored pairs, cross-encoder pairs,
      embedding rows) split it evenly, then take what the others left, then their floors.
    * Until the model is `ready` (its first few steps) only the floors are admitted beside decodes.
    * `cadence` (a CadenceGuard; `tandem serve --tpot-target-ms` runs one) scales the planned limit so that the time
      between a decode's tokens, as the engine sees it (steps and the time between them), is over the target in at
      most its `exceed` share (1%) of the steps the policy planned: what the model's margin does not cover on a busy
      host.
    """
    tpot_target_s: float
    model: "LinearStepTime" = field(default_factory=OnlineStepTime)
    rerank_share: float = 0.5
    min_prefill_tokens: int = 32
    rerank_floor: float = 0.1  # share of the target the per-step rerank floor may cost (LLM-scored pairs)
    max_pair_wait_steps: int = 128  # steps a single-stage encoder row (pair) waits for room before it rides regardless
    max_stage_wait_steps: int = 16  # steps a staged encoder row waits before one stage rides regardless
    fallback: AdmissionPolicy | None = None
    cadence: CadenceGuard | None = None

    _planned: bool = field(default=False, init=False, repr=False)  # this step admitted work by the model's plan

    _prefill_over: int = field(default=0, init=False, repr=False)  # floor tokens prefill_budget gave this step
    # Per kind of scoring work: steps in a row it waited and none of it rode
    _starved: dict[TokenKind, int] = field(default_factory=dict, init=False, repr=False)

    observes_steps = True

    def __post_init__(self) -> None:
        if not self.tpot_target_s > 0:
            raise ValueError(f"tpot_target_s must be > 0, got {self.tpot_target_s!r}")
        if not 0.0 <= self.rerank_floor <= 1.0:
            raise ValueError(f"rerank_floor must be in [0, 1], got {self.rerank_floor!r}")
        if self.max_pair_wait_steps < 0 or self.max_stage_wait_steps < 0:
            raise ValueError(f"max_pair_wait_steps and max_stage_wait_steps must be >= 0, got "
                             f"{self.max_pair_wait_steps!r}, {self.max_stage_wait_steps!r}")
        if self.fallback is None:
            self.fallback = ShareAdmission(self.rerank_share)

    @property
    def target_s(self) -> float:
        return self.tpot_target_s

    def limit_s(self) -> float:
        """The predicted step time admissions stay under: the target less the model's error margin, scaled by the
        cadence guard."""
        if not self.model.ready:
            return 0.0
        scale = self.cadence.scale if self.cadence is not None else 1.0
        return scale * self.tpot_target_s / (1.0 + self.model.margin())

    def predict(self, batch: Batch) -> float:
        return self.model.predict(StepShape.of_batch(batch))

    def observe(self, record: "StepRecord") -> None:
        self.model.observe(StepShape.of_record(record), record.duration_s)
        if self.cadence is not None:
            self.cadence.observe(record.start_time, record.duration_s, record.decode_tokens > 0, self._planned)
        self._planned = False

    def prefill_budget(self, step: AdmissionStep, continuing: list["Sequence"]) -> int:
        batch = step.batch
        if not batch.num_decode_tokens or not continuing:
            return step.budget
        urgent = min(s.priority for s in continuing)
        if urgent < batch.min_decode_priority:
            return step.budget  # a prompt more urgent than every decode: not held to the objective
        # Prompts already running keep their place before new admissions, but not before more urgent pairs, and
        # at equal priority they leave the pairs their share of the headroom.
        head = step.rerank_head()
        share = 1.0 if head is None or head.priority > urgent else 0.0 if head.priority < urgent \
            else 1.0 - self.rerank_share
        allowed = self._tokens(step, TokenKind.PREFILL, self.limit_s(), share)
        granted = min(step.budget, max(allowed, self.min_prefill_tokens))
        self._prefill_over = max(0, granted - allowed)
        return granted

    def _tokens(self, step: AdmissionStep, kind: TokenKind, limit: float, share: float = 1.0) -> int:
        """Tokens of `kind` that keep the step's predicted time under `limit`, or under its `share` of the headroom."""
        shape = StepShape.of_batch(step.batch)
        if share < 1.0:
            now = self.model.predict(shape)
            limit = now + max(0.0, limit - now) * share
        tokens = self.model.tokens_within(shape, kind, limit)
        self._planned = self._planned or tokens > 0
        return tokens

    def rerank_floor_tokens(self, batch: Batch | None = None) -> int:
        """LLM-scored rerank tokens every step computes while pairs wait: those whose predicted cost beside `batch`
        is `rerank_floor` x the target (at least one), and never so many that they take a narrow step past the
        model's `wide_rows` (the quantized CPU matmul's switch to dequantize + GEMM, whose fixed cost the fit rarely
        sees beside decodes: 8 decodes and a 3-token floor ran 77-85 ms against 28 predicted, with one thread)."""
        shape = StepShape.of_batch(batch) if batch is not None else StepShape(decode_rows=1)
        now = self.model.predict(shape)
        limit = now + self.rerank_floor * self.tpot_target_s
        tokens = max(1, self.model.tokens_within(shape, TokenKind.LLM_RERANK, limit))
        wide = getattr(self.model, "wide_rows", None)
        if wide is not None and shape.llm_rows <= wide:
            tokens = min(tokens, max(1, wide - shape.llm_rows))
        return tokens

    def admit(self, step: AdmissionStep) -> None:
        waiting = [kind for kind in _SCORING_KINDS if step.rerank_head(kind) is not None]
        self._admit(step)
        for kind in _SCORING_KINDS:
            starved = kind in waiting and not _scored(step.batch, kind)
            self._starved[kind] = self._starved.get(kind, 0) + 1 if starved else 0

    def _admit(self, step: AdmissionStep) -> None:
        batch = step.batch
        if not batch.num_decode_tokens:
            self.fallback.admit(step)
            return
        self._admit_urgent(step, batch.min_decode_priority)
        # Prefill the floor gave running prompts beyond their share does not count against the others.
        over, self._prefill_over = min(self._prefill_over, batch.num_prefill_tokens), 0
        limit = self.limit_s() + over * self.model.token_cost_s(TokenKind.PREFILL)
        rerank, gen = step.rerank_head(), step.generation_head()
        if rerank is not None and gen is not None and rerank.priority != gen.priority:
            order = (self._fill_rerank, self._fill_generation) if rerank.priority < gen.priority \
                else (self._fill_generation, self._fill_rerank)
            for fill in order:
                fill(step, limit)
            return
        if rerank is not None and gen is not None:  # one priority: pairs' share of the headroom and seats first
            self._fill_rerank(step, limit, self.rerank_share, max(1, int(step.free_seats * self.rerank_share)))
        self._fill_generation(step, limit)
        self._fill_rerank(step, limit)

    def _admit_urgent(self, step: AdmissionStep, decode_priority: int) -> None:
        """Admit, most urgent first, the heads declared more urgent than every decode, with the whole budget."""
        while True:
            rerank, gen = step.rerank_head(), step.generation_head()
            urgent_rerank = rerank is not None and rerank.priority < decode_priority
            urgent_gen = gen is not None and gen.priority < decode_priority
            if urgent_rerank and (not urgent_gen or (rerank.priority, rerank.arrival) < (gen.priority, gen.arrival)):
                admitted = step.admit_rerank(max_seats=1)
            elif urgent_gen:
                admitted = step.admit_generation(max_seats=1)
            else:
                return
            if not admitted:
                return

    def _fill_rerank(self, step: AdmissionStep, limit: float, share: float = 1.0, seats: int | None = None) -> None:
        # Each kind of scoring work (LLM-scored pairs, cross-encoder pairs, embedding rows) is priced as itself. The
        # kinds whose heads share the most urgent priority split the headroom evenly (each sized in its part), then
        # every kind, most urgent first, may take what the others left; a kind that still got nothing has its
        # floor. So every kind progresses beside the decodes: embeddings behind a long rerank queue too.
        heads = sorted((h.priority, h.arrival, kind) for kind in _SCORING_KINDS if (h := step.rerank_head(kind)))
        if not heads:
            return
        kinds = [kind for _, _, kind in heads]
        first = [kind for priority, _, kind in heads if priority == heads[0][0]]
        now = self.model.predict(StepShape.of_batch(step.batch))
        cap = now + max(0.0, limit - now) * share  # what scoring work may take of this call's headroom
        if len(kinds) > 1:  # the other kinds' floors first, or the first kind's share would leave them no room
            for kind in kinds:
                if not _scored(step.batch, kind):
                    self._floor(step, kind, seats, within_target=True)
        for i, kind in enumerate(first):
            tokens = self._tokens(step, kind, cap, 1.0 / (len(first) - i))
            if tokens:
                step.admit_rerank(tokens, seats, kind)
        for kind in kinds:
            tokens = self._tokens(step, kind, cap)
            if tokens:
                step.admit_rerank(tokens, seats, kind)
        for kind in kinds:
            if not _scored(step.batch, kind):
                self._floor(step, kind, seats)

    def _floor(self, step: AdmissionStep, kind: TokenKind, seats: int | None, within_target: bool = False) -> None:
        """The least `kind` gets in a step that had no room for it (`within_target`: only a floor that keeps the
        step's predicted time within the target)."""
        head = step.rerank_head(kind)
        if head is None:
            return
        if head.uses_kv:  # a few tokens of the next pair's chunk
            tokens = self.rerank_floor_tokens(step.batch)
            if not within_target or self.model.tokens_within(StepShape.of_batch(step.batch), kind,
                                                             self.tpot_target_s) >= tokens:
                step.admit_rerank(tokens, seats, kind)
        elif head.staged and (self._starved.get(kind, 0) >= self.max_stage_wait_steps or self.model.tokens_within(
                StepShape.of_batch(step.batch), kind, self.tpot_target_s) >= head.stage_tokens(1)):
            # an encoder row: one stage (layer) while the step stays within the target itself (the margin aside),
            # or, having waited its (short) bound, whatever the model says it costs: a stage is a small step over
            # at worst, and the only way a kind the model has not seen beside decodes gets its cost measured
            step.admit_rerank(head.stage_tokens(1), 1, kind)
        elif self._starved.get(kind, 0) >= self.max_pair_wait_steps and not within_target:
            # waited its bound: one pair, whatever it costs
            step.admit_rerank(max_seats=1, kind=kind)

    def _fill_generation(self, step: AdmissionStep, limit: float) -> None:
        if step.generation_head() is None:
            return
        tokens = self._tokens(step, TokenKind.PREFILL, limit)
        tokens = max(tokens, self.min_prefill_tokens - step.batch.num_prefill_tokens)  # the prefill floor
        if tokens > 0:
            step.admit_generation(tokens)


_SCORING_KINDS = (TokenKind.LLM_RERANK, TokenKind.CROSS_ENCODER, TokenKind.EMBED)


def _scored(batch: Batch, kind: TokenKind) -> int:
    """How much scoring work of `kind` the batch holds (sequences, so a zero-cost stage of a row counts too)."""
    if kind is TokenKind.EMBED:
        return batch.num_embed_rows
    if kind is TokenKind.CROSS_ENCODER:
        return batch.num_cross_encoder_tokens
    return batch.num_rerank_tokens - batch.num_cross_encoder_tokens


def scoring_kind(seq: "Sequence") -> TokenKind:
    """How the step-time model prices a scoring-queue sequence's tokens: an embedding row's, an LLM-scored pair's
    or a cross-encoder pair's."""
    if seq.kind is SeqKind.EMBED:
        return TokenKind.EMBED
    return TokenKind.LLM_RERANK if seq.uses_kv else TokenKind.CROSS_ENCODER


def policy_for(config: EngineConfig, given: AdmissionPolicy | None = None, wide_rows: int | None = None
               ) -> AdmissionPolicy:
    """The admission policy an engine built from `config` runs: `given` (any AdmissionPolicy object), else a
    LatencyAdmission with config.tpot_target_ms (its step-time model told `wide_rows`, the LLM rows above which the
    forward takes a costlier path), else a ShareAdmission with config.rerank_share."""
    if given is not None:
        if not isinstance(given, AdmissionPolicy):
            raise ValueError(f"admission must be an AdmissionPolicy or None, got {given!r}")
        if config.tpot_target_ms is not None:
            raise ValueError("tpot_target_ms and admission are both set: give LatencyAdmission(tpot_target_s=...) "
                             "as the admission policy instead")
        return given
    if config.tpot_target_ms is not None:
        return LatencyAdmission(config.tpot_target_ms / 1000, model=OnlineStepTime(wide_rows=wide_rows),
                                rerank_share=config.rerank_share,
                                cadence=CadenceGuard(config.tpot_target_ms / 1000))
    return ShareAdmission(config.rerank_share)
