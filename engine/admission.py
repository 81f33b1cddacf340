"""Admission: a pure planner that says how much of each kind of waiting work a step may take.

The scheduler builds a `StepView` (what already rides: the decodes; what waits, per kind of work: its most urgent
head's priority and age, its smallest unit, how long the kind went without progress) and asks its policy for a
`Quota`: an ordered list of `Grant`s (a kind, at most so many tokens and new seats). The scheduler alone fills the
batch from the quota, in order; the policy never sees the scheduler's queues. `plan` is a function of the view and
of the step-time model's coefficients: the same view gives the same quota.

Two policies:

* `LatencyAdmission`, the default: while decodes ride in a step, every other kind of work fills only the headroom
  the step-time model predicts under the objective T (a fixed `tpot_target_s`, or, with None, `auto_factor` x the
  predicted step of the running decodes and the chats waiting to join them, up to the rows the model's narrow path
  takes, floored at `min_target_s`: chats keep >= 80% of the speed they have together).
  Until the model is ready (calibrated at start-up, or after its first few steps) the fallback plans. Kinds at the
  most urgent priority split the headroom evenly, then each may take what the others left. One
  minimum-progress rule replaces floors and caps: a kind that waits and got nothing gets its smallest unit when that
  unit fits under T by itself (the margin aside), or, having waited `progress_steps` steps or `progress_s` seconds,
  whatever it costs. Work more urgent than every decode is not held to the objective. With no decodes in
  the step there is nothing to protect: `fallback` (a ShareAdmission) decides.
* `ShareAdmission` (`tpot_target_ms` off): plain budget filling; while generation needs the step too, scoring work
  gets `rerank_share` of the budget and seats first.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine.batch import Batch
from engine.cadence import CadenceGuard
from engine.config import EngineConfig
from engine.step_time import OnlineStepTime, StepShape, TokenKind

if TYPE_CHECKING:
    from engine.outputs import StepRecord
    from engine.step_time import LinearStepTime

SCORING_KINDS = (TokenKind.LLM_RERANK, TokenKind.CROSS_ENCODER, TokenKind.EMBED)


@dataclass(frozen=True, slots=True)
class Waiting:
    """One kind of work that waits (prompts: new or part-way through their chunked prefill; pairs and rows: new or
    part-way through their chunks or stages)."""
    kind: TokenKind
    priority: int  # the most urgent head's (aged) priority: lower goes first
    urgency: int  # the priority it is weighed against the decodes at (the scheduler's `_urgency`)
    arrival: int  # that head's arrival order
    unit: int  # what minimum progress gives: a chunk of a prompt or an LLM-scored pair, one stage, a whole pair
    least: int  # the fewest tokens of that head a step can take (a token of a chunked kind, else `unit`)
    tokens: int  # tokens of this kind that could run (what any grant can use at most)
    steps_waited: int = 0  # steps in a row this kind waited and none of it rode
    seconds_waited: float = 0.0  # seconds since it last rode (or since it began to wait)


@dataclass(frozen=True, slots=True)
class StepView:
    """What a policy sees of one step: what already rides in it, and what waits."""
    shape: StepShape  # the decodes already in the step
    decode_priority: int | None  # the most urgent decode's priority (None: no decodes)
    budget: int  # tokens left in the step's budget
    free_seats: int  # sequences that may still join the running set
    waiting: tuple[Waiting, ...] = ()  # most urgent first
    wide_budget: int = 0  # a step of embedding rows alone may take this many tokens (max_embed_batch_tokens)
    joining: int = 0  # chats waiting to join the decodes (prompts not done yet), at most the free seats

    def of(self, kind: TokenKind) -> Waiting | None:
        return next((w for w in self.waiting if w.kind is kind), None)


@dataclass(frozen=True, slots=True)
class Grant:
    """At most `tokens` tokens (None: what the budget has left) and `seats` new seats (None: any) of `kind` (None:
    any scoring kind, most urgent first)."""
    kind: TokenKind | None
    tokens: int | None = None
    seats: int | None = None


@dataclass(frozen=True, slots=True)
class Quota:
    """What a step may take, in the order the scheduler fills it."""
    grants: tuple[Grant, ...] = ()
    budget: int | None = None  # the step's token budget, when the policy widens it (None: the scheduler's)
    target_s: float | None = None  # the step time the decodes are kept under (None: no objective in this step)
    limit_s: float | None = None  # the predicted step time admissions were planned under
    planned: bool = False  # the objective sized admissions beside decodes (beyond minimum progress)


@runtime_checkable
class AdmissionPolicy(Protocol):
    """`plan` is all a policy must write; the engine calls `predict` and, when `observes_steps`, `observe`."""
    observes_steps: bool = False  # True: the engine builds a StepRecord every step and hands it to observe()

    def plan(self, view: StepView) -> Quota:
        raise NotImplementedError

    def predict(self, batch: Batch) -> float | None:
        """Predicted seconds of the step that runs `batch` (None: this policy has no step-time model)."""
        return None

    def observe(self, record: "StepRecord") -> None:
        """What the step the engine just ran did and took (called when observes_steps)."""


@dataclass(slots=True)
class ShareAdmission(AdmissionPolicy):
    """Plain budget filling: while generation needs the step too (prompts wait, or decodes ride in it), scoring work
    gets `rerank_share` of the budget and of the free seats first (always room for its smallest unit), prompts the
    rest; with no decodes, scoring also takes what the prompts left. A step of embedding rows alone, with nothing
    else waiting, is widened to `wide_budget` (no decode is in it to slow down)."""
    rerank_share: float = 0.5

    def plan(self, view: StepView) -> Quota:
        scoring = [w for w in view.waiting if w.kind is not TokenKind.PREFILL]
        decodes = view.shape.decode_rows > 0
        if scoring and (decodes or view.of(TokenKind.PREFILL)):
            cap = max(int(view.budget * self.rerank_share), scoring[0].unit)
            grants = [Grant(None, cap, max(1, int(view.free_seats * self.rerank_share))), Grant(TokenKind.PREFILL)]
            if not decodes:
                grants.append(Grant(None))
            return Quota(tuple(grants))
        if [w.kind for w in scoring] == [TokenKind.EMBED] and not decodes and view.wide_budget > view.budget:
            return Quota((Grant(TokenKind.EMBED),), budget=view.wide_budget)
        return Quota((Grant(TokenKind.PREFILL), Grant(None)))


@dataclass(slots=True)
class LatencyAdmission(AdmissionPolicy):
    """The latency objective (see the module docstring). `tpot_target_s` None: the automatic target."""
    tpot_target_s: float | None = None
    model: "LinearStepTime" = field(default_factory=OnlineStepTime)
    auto_factor: float = 1.25  # automatic target: this x the predicted step of the decodes and the chats joining them
    min_target_s: float = 0.005  # ... and never under this
    progress_steps: int = 16  # a kind that got nothing this many steps in a row gets its unit whatever it costs
    progress_s: float = 1.0  # ... and likewise after this many seconds
    rerank_share: float = 0.5  # the fallback's (no decodes in the step)
    fallback: AdmissionPolicy | None = None
    cadence: CadenceGuard | None = None

    observes_steps = True

    def __post_init__(self) -> None:
        if self.tpot_target_s is not None and not self.tpot_target_s > 0:
            raise ValueError(f"tpot_target_s must be > 0 or None (automatic), got {self.tpot_target_s!r}")
        if not self.auto_factor >= 1.0 or not self.min_target_s > 0:
            raise ValueError(f"auto_factor must be >= 1 and min_target_s > 0, got {self.auto_factor!r}, "
                             f"{self.min_target_s!r}")
        if self.progress_steps < 1 or not self.progress_s > 0:
            raise ValueError(f"progress_steps must be >= 1 and progress_s > 0, got {self.progress_steps!r}, "
                             f"{self.progress_s!r}")
        if self.fallback is None:
            self.fallback = ShareAdmission(self.rerank_share)

    def target_for(self, shape: StepShape, joining: int = 0) -> float:
        """T for a step whose decodes are `shape`, `joining` more chats about to decode beside them: the fixed
        target, or the automatic one, priced at the decode step they will share (a burst of chats is not fed to the
        first one's step a few prompt tokens at a time), up to the rows of the model's narrow path (past it, a
        step's price jumps: a burst of 32 would widen T for scoring work too)."""
        if self.tpot_target_s is not None:
            return self.tpot_target_s
        rows = shape.decode_rows + joining
        if self.model.wide_rows is not None:
            rows = min(rows, max(shape.decode_rows, self.model.wide_rows))
        context = shape.decode_context_tokens * rows // max(1, shape.decode_rows)
        return max(self.min_target_s, self.auto_factor * self.model.predict(StepShape(rows, context)))

    def limit_for(self, target_s: float) -> float:
        """The predicted step time admissions stay under: T less the model's error margin, scaled by the cadence
        guard (0 until the model is ready)."""
        if not self.model.ready:
            return 0.0
        return self._scale() * target_s / (1.0 + self.model.margin())

    def _scale(self) -> float:
        return self.cadence.scale if self.cadence is not None else 1.0

    def predict(self, batch: Batch) -> float:
        return self.model.predict(StepShape.of_batch(batch))

    def observe(self, record: "StepRecord") -> None:
        self.model.observe(StepShape.of_record(record), record.duration_s)
        if self.cadence is not None and record.target_s is not None:
            self.cadence.observe(record.start_time, record.duration_s, record.decode_tokens > 0, record.planned,
                                 record.target_s)

    def plan(self, view: StepView) -> Quota:
        if view.decode_priority is None or not self.model.ready:
            # nothing to protect, or no prices yet (an engine not calibrated, in its first steps): plain budget
            # filling (a fixed target is still reported)
            fixed = self.tpot_target_s
            return replace(self.fallback.plan(view), target_s=fixed,
                           limit_s=None if fixed is None else self.limit_for(fixed))
        target = self.target_for(view.shape, view.joining)
        limit = self.limit_for(target)
        grants: list[Grant] = []
        shape = view.shape
        urgent = [w for w in view.waiting if w.urgency < view.decode_priority]
        held = [w for w in view.waiting if w.urgency >= view.decode_priority]
        for w in urgent:  # more urgent than every decode: not held to the objective
            grants.append(Grant(w.kind, None, None))
            shape = _plus(shape, w.kind, min(w.tokens, view.budget))
        got: dict[TokenKind, int] = {w.kind: w.tokens for w in urgent}
        planned = False
        # The most urgent priority's kinds split the headroom evenly (each priced as itself, each at least its least
        # unit while the headroom holds it), in arrival order.
        first = [w for w in held if w.priority == held[0].priority] if held else []
        now = self.model.predict(shape)
        for i, w in enumerate(first):
            cap = now + max(0.0, limit - now) / (len(first) - i) if len(first) > 1 else limit
            n = self._fit(shape, w, cap, view.budget - sum(got.values()))
            if not n and self.model.predict(_plus(shape, w.kind, w.least)) <= limit:
                n = w.least  # a share too small for its least unit: that unit, while the headroom holds it
            if n:
                grants.append(Grant(w.kind, n, _seats(view.free_seats, len(first)) if len(first) > 1 else None))
                shape, got[w.kind], planned = _plus(shape, w.kind, n), got.get(w.kind, 0) + n, True
            now = self.model.predict(shape)
        for w in held:  # then every kind, most urgent first, what the others left
            n = self._fit(shape, w, limit, view.budget - sum(got.values()))
            if n:
                grants.append(Grant(w.kind, n))
                shape, got[w.kind], planned = _plus(shape, w.kind, n), got.get(w.kind, 0) + n, True
        for w in held:  # minimum progress
            if got.get(w.kind, 0):
                continue
            # priced: the unit rides when the step stays under T with it (a plan the cadence guard then judges);
            # unpriced: after its wait bound, whatever it costs (the guard does not count such a step)
            unit = self._narrow_unit(shape, w)
            with_unit = self.model.predict(_plus(shape, w.kind, unit)) if self.model.ready else float("inf")
            fits = with_unit <= target
            if fits or w.steps_waited >= self.progress_steps or w.seconds_waited >= self.progress_s:
                grants.append(Grant(w.kind, unit, 1))
                shape, got[w.kind] = _plus(shape, w.kind, unit), got.get(w.kind, 0) + unit
                planned = planned or with_unit <= self._scale() * target  # within what the guard allows now
        return Quota(tuple(grants), target_s=target, limit_s=limit, planned=planned)

    def _narrow_unit(self, shape: StepShape, w: Waiting) -> int:
        """`w`'s unit, or, for a chunked kind whose unit would take the step onto the model's costlier wide path,
        the tokens left before it (`narrow_room`): 8 decodes + a 16-token chunk would go wide, 8 + 8 stay narrow."""
        room = self.model.narrow_room(shape, w.kind)
        if room is not None and w.least < w.unit and 0 < room < w.unit:
            return max(w.least, room)
        return w.unit

    def _fit(self, shape: StepShape, w: Waiting, limit: float, budget: int) -> int:
        """Tokens of `w`'s kind under `limit` (0 when fewer than the least of it a step can take fit)."""
        n = min(self.model.tokens_within(shape, w.kind, limit), w.tokens, max(0, budget))
        return n if n >= w.least else 0


def _seats(free: int, kinds: int) -> int:
    return max(1, free // kinds)


def _plus(shape: StepShape, kind: TokenKind, tokens: int) -> StepShape:
    """`shape` with `tokens` more of `kind`."""
    return replace(shape, **{kind.value: getattr(shape, kind.value) + tokens})


AUTO = "auto"


def policy_for(config: EngineConfig, given: AdmissionPolicy | None = None, wide_rows: int | None = None
               ) -> AdmissionPolicy:
    """The admission policy an engine built from `config` runs: `given` (any AdmissionPolicy object), else the
    latency objective (config.tpot_target_ms: a number of ms, or "auto"; its step-time model told `wide_rows`, the
    LLM rows above which the forward takes a costlier path), else (tpot_target_ms None: off) plain budget filling."""
    if given is not None:
        if not isinstance(given, AdmissionPolicy):
            raise ValueError(f"admission must be an AdmissionPolicy or None, got {given!r}")
        return given
    if config.tpot_target_ms is None:
        return ShareAdmission(config.rerank_share)
    target = None if config.tpot_target_ms == AUTO else config.tpot_target_ms / 1000
    return LatencyAdmission(target, model=OnlineStepTime(wide_rows=wide_rows), rerank_share=config.rerank_share,
                            cadence=CadenceGuard())
