"""Admission: a planner that says how much of each kind of waiting work a step may take.

The scheduler builds a `StepView` (what already rides: the decodes; what waits, per kind of work: its most urgent
head's priority, its smallest unit, the tokens that could run) and asks its policy for a `Quota`: an ordered list of
`Grant`s (a kind, at most so many tokens and new seats). The scheduler alone fills the batch from the quota, in order;
the policy never sees the scheduler's queues. `plan` is a function of the view, of the step-time model's coefficients
and of the policy's ledger (below), which only `observe` writes: the same view gives the same quota.

Two policies:

* `LatencyAdmission`, the default: shares of each step's time. While decodes ride in a step and other work waits,
  the step has a time beside the decodes: under the automatic target the others' share of the step (the decodes get
  `decode_share` of it: T = the predicted step of the running decodes and the chats waiting to join them, up to the
  rows of the model's narrow path, / decode_share); under a fixed `tpot_target_s` what T (less the model's margin, as
  the cadence guard scales it) leaves beside the decodes (a T the decodes alone break: the automatic share). One rule
  splits that time among the kinds that wait (prompts, LLM-scored pairs, cross-encoder pairs, embedding rows) by
  weight (`weights`, halved per priority level below the most urgent waiting one; under the automatic shares the
  chats' prompts are the chats' own time: the scoring kinds split all of it among themselves, and the prompts'
  weight's part comes on top of T): each kind's owed seconds, plus
  what the ledger saved for it, buy its tokens as the step-time model prices them; then each may take what the
  others left (work-conserving). The ledger keeps, per waiting kind, the time it was owed and could not use, up to
  the price of its least unit: a unit bigger than a step's share (a cross-encoder pair, an encoder stage) rides once
  its share has saved for it, and a chunk's leftover is carried, so over a run every kind gets its share. Under a
  fixed T a step stays under its limit except for such a saved-for unit. With deadlines, late work takes its share
  first; work still on time then takes, earliest deadline first, what keeps it on time at this cadence (`pace_s`),
  then the rest of the step up to what the decodes' slack lends (`lend_limit`). Work more urgent than every decode is
  not held to the objective. Until the model is ready (calibrated at start-up, or after its first few steps), and
  with no decodes in the step (nothing to protect), `fallback` (a ShareAdmission) decides.
* `ShareAdmission` (`tpot_target_ms` off): plain budget filling; while generation needs the step too, scoring work
  gets `scoring_share` of the budget and seats first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine.batch import Batch, Owed
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
    unit: int  # its natural unit: a chunk of a prompt or an LLM-scored pair, one stage, a whole pair
    least: int  # the fewest tokens of that head a step can take (a token of a chunked kind, else `unit`)
    tokens: int  # tokens of this kind that could run (what any grant can use at most)
    deadline: float | None = None  # when that head's request's first result is due (None: it has no deadline)


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
    now: float = 0.0  # the clock the deadlines are on
    # Per decode row that has a deadline: (its first token's deadline, the tokens it has produced); its next token
    # is due that many paces after the first (the policy knows the pace).
    paces: tuple[tuple[float, int], ...] = ()

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
    planned: bool = False  # the objective sized admissions beside decodes
    owed: tuple[Owed, ...] = ()  # the share of this step each waiting kind was owed (the ledger settles it)


@runtime_checkable
class AdmissionPolicy(Protocol):
    """`plan` is all a policy must write; the engine calls `predict` and, when `observes_steps`, `observe`."""
    observes_steps: bool = False  # True: the engine builds a StepRecord every step and hands it to observe()

    def plan(self, view: StepView) -> Quota:
        raise NotImplementedError

    def predict(self, batch: Batch) -> float | None:
        """Predicted seconds of the step that runs `batch` (None: this policy has no step-time model)."""
        return None

    def deadline(self, alone: StepShape, arrival_time: float) -> float | None:
        """When a request that arrived at `arrival_time` is due its first result (a chat's first token, a rerank's
        scores, an embedding's vectors), given `alone`: all of its work as one step (None: no deadline)."""
        return None

    def observe(self, record: "StepRecord") -> None:
        """What the step the engine just ran did and took (called when observes_steps)."""


@dataclass(slots=True)
class ShareAdmission(AdmissionPolicy):
    """Plain budget filling: while generation needs the step too (prompts wait, or decodes ride in it), scoring work
    gets `scoring_share` of the budget and of the free seats first (always room for its smallest unit), prompts the
    rest; with no decodes, scoring also takes what the prompts left. A step of embedding rows alone, with nothing
    else waiting, is widened to `wide_budget` (no decode is in it to slow down)."""
    scoring_share: float = 0.5

    def plan(self, view: StepView) -> Quota:
        scoring = [w for w in view.waiting if w.kind is not TokenKind.PREFILL]
        decodes = view.shape.decode_rows > 0
        if scoring and (decodes or view.of(TokenKind.PREFILL)):
            cap = max(int(view.budget * self.scoring_share), scoring[0].unit)
            grants = [Grant(None, cap, max(1, int(view.free_seats * self.scoring_share))), Grant(TokenKind.PREFILL)]
            if not decodes:
                grants.append(Grant(None))
            return Quota(tuple(grants))
        if [w.kind for w in scoring] == [TokenKind.EMBED] and not decodes and view.wide_budget > view.budget:
            return Quota((Grant(TokenKind.EMBED),), budget=view.wide_budget)
        return Quota((Grant(TokenKind.PREFILL), Grant(None)))


# How the time a step leaves beside the decodes is split among the kinds of work that wait (at one priority; a kind
# `p` levels less urgent than the most urgent waiting one weighs 2**-p of this).
DEFAULT_WEIGHTS = {TokenKind.PREFILL: 1.0, TokenKind.LLM_RERANK: 1.0, TokenKind.CROSS_ENCODER: 1.0,
                   TokenKind.EMBED: 1.0}


@dataclass(slots=True)
class LatencyAdmission(AdmissionPolicy):
    """The latency objective, as shares of each step's time (see the module docstring). `tpot_target_s` None: the
    automatic target (the decodes take `decode_share` of each step while other work waits)."""
    tpot_target_s: float | None = None
    model: "LinearStepTime" = field(default_factory=OnlineStepTime)
    decode_share: float = 0.75  # automatic target: the decodes' share of a step's time while other work waits
    weights: dict[TokenKind, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    min_target_s: float = 0.005  # the automatic target is never under this
    # Deadlines: a request is due its first result `stretch` times what its work costs alone after it arrived; a
    # chat's later tokens one pace apart after its first (`pace`). A step may run past its limit for work that is
    # still on time while every decode is ahead of its pace, up to when the most urgent one's next token is due and
    # at most one pace.
    stretch: float | None = 4.0  # None: no deadlines
    max_lend: float = 1.5  # the automatic pace: this many times the decodes' own step
    # With deadlines and no decodes in the step, the step may be held to a quantum: its forwards' fixed cost over
    # this share (so the fixed costs stay that share of the step), the waiting work taken earliest deadline first;
    # work that arrives meanwhile waits one quantum, not a whole prompt chunk or a wide batch of embedding rows.
    # None (the default): off. Measured in bench.rag at 0.05 it made a lone RAG request's rerank 15-25% slower (a wide
    # batch of embedding rows cut into 0.1 s steps costs more per row than the linear model says) and its idle TTFT
    # 1.99 s against 1.64 s, with no gain under load (docs/latency-objective.md).
    overhead_share: float | None = None
    scoring_share: float = 0.5  # the fallback's (no decodes in the step)
    fallback: AdmissionPolicy | None = None
    cadence: CadenceGuard | None = None
    # The ledger: seconds of step time each waiting kind was owed and could not use yet (its least unit cost more),
    # written by observe() alone, read by plan().
    credit: dict[TokenKind, float] = field(default_factory=dict)
    # The target of the last step that had one (observe() writes it): a request that arrives waits up to one such
    # step before its work can start, which its deadline allows on top of its stretched price.
    step_s: float = 0.0

    observes_steps = True

    def __post_init__(self) -> None:
        if self.tpot_target_s is not None and not self.tpot_target_s > 0:
            raise ValueError(f"tpot_target_s must be > 0 or None (automatic), got {self.tpot_target_s!r}")
        if not 0.0 < self.decode_share < 1.0 or not self.min_target_s > 0:
            raise ValueError(f"decode_share must be in (0, 1) and min_target_s > 0, got {self.decode_share!r}, "
                             f"{self.min_target_s!r}")
        if self.overhead_share is not None and not 0.0 < self.overhead_share < 1.0:
            raise ValueError(f"overhead_share must be in (0, 1) or None, got {self.overhead_share!r}")
        if (self.stretch is not None and not self.stretch >= 1.0) or not self.max_lend >= 1.0:
            raise ValueError(f"stretch and max_lend must be >= 1, got {self.stretch!r}, {self.max_lend!r}")
        unknown = set(self.weights) - set(TokenKind)
        if unknown or any(not w > 0 for w in self.weights.values()):
            raise ValueError(f"weights must map kinds of work to weights > 0, got {self.weights!r}")
        self.weights = {**DEFAULT_WEIGHTS, **self.weights}
        if self.fallback is None:
            self.fallback = ShareAdmission(self.scoring_share)

    def target_for(self, shape: StepShape, joining: int = 0) -> float:
        """T for a step whose decodes are `shape`, `joining` more chats about to decode beside them: the fixed
        target, or the automatic one: the decode step they will share (a burst of chats is not fed to the first
        one's step a few prompt tokens at a time), up to the rows of the model's narrow path (past it, a step's
        price jumps: a burst of 32 would widen T for the other work too), over the decodes' share."""
        if self.tpot_target_s is not None:
            return self.tpot_target_s
        rows = shape.decode_rows + joining
        if self.model.wide_rows is not None:
            rows = min(rows, max(shape.decode_rows, self.model.wide_rows))
        context = shape.decode_context_tokens * rows // max(1, shape.decode_rows)
        return max(self.min_target_s, self.model.predict(StepShape(rows, context)) / self.decode_share)

    def limit_for(self, target_s: float) -> float:
        """The predicted step time admissions stay under: a fixed T less the model's error margin, scaled by the
        cadence guard; the automatic T as it is (a share of time, not a bound to hold each step to). 0 until the
        model is ready."""
        if not self.model.ready:
            return 0.0
        if self.tpot_target_s is None:
            return target_s
        return self._scale() * target_s / (1.0 + self.model.margin())

    def _scale(self) -> float:
        return self.cadence.scale if self.cadence is not None else 1.0

    def predict(self, batch: Batch) -> float:
        return self.model.predict(StepShape.of_batch(batch))

    def deadline(self, alone: StepShape, arrival_time: float) -> float | None:
        """`stretch` times the work's price alone after its arrival, plus the step it may have to wait for (None
        until the model has prices)."""
        if not self.model.ready or self.stretch is None:
            return None
        return arrival_time + self.stretch * self.model.predict(alone) + self.step_s

    def pace(self, shape: StepShape) -> float:
        """Seconds between a chat's tokens that its deadlines allow, beside decodes `shape`: a user's target, or
        `max_lend` times the decodes' own step (the automatic target's bound on a chat's time per token)."""
        if self.tpot_target_s is not None:
            return self.tpot_target_s
        return self.max_lend * self.model.predict(shape)

    def lend_limit(self, view: StepView, limit: float) -> float:
        """How long this step may run for work that is still on time: `limit`, or longer while every decode is
        ahead of its pace (its next token due a pace per token after its first), up to when the most urgent one's
        next token is due and at most one pace."""
        if not view.paces:
            return limit
        pace = self.pace(view.shape)
        due = min(first + n * pace for first, n in view.paces)
        return max(limit, min(due - view.now, pace))

    def pace_s(self, w: Waiting, now: float, base: float, cadence: float) -> float:
        """Seconds of this step that `w` (still on time) needs to be done by its deadline: its waiting work's price
        alone over the steps left before one step (`cadence`) ahead of the deadline, a step being `cadence` or the step
        this need makes beside `base` (the step so far), whichever is longer: with a = that price / that time left,
        a x max(cadence, base / (1 - a)); inf (all the caller allows) within that last step. 0 for work that could not
        make it even alone (its price over the time left): it is served as late work is."""
        price, left = self.model.predict(_plus(StepShape(), w.kind, w.tokens)), w.deadline - now
        if price >= left:
            return 0.0
        # Aimed one step early (`cadence`), so the model's error does not put the first result just past its
        # deadline; within that last step, all of the step the caller allows.
        a = price / max(left - cadence, 1e-9)
        return a * max(cadence, base / (1.0 - a)) if a < 1.0 else math.inf

    def observe(self, record: "StepRecord") -> None:
        if record.target_s is not None:
            self.step_s = record.target_s
        shape = StepShape.of_record(record)
        self.model.observe(shape, record.duration_s)
        if self.cadence is not None and record.target_s is not None and self.tpot_target_s is not None:
            self.cadence.observe(record.start_time, record.duration_s, record.decode_tokens > 0, record.planned,
                                 record.target_s)
        self._settle(shape, record.owed)

    def _settle(self, shape: StepShape, owed: tuple[Owed, ...]) -> None:
        """The ledger after a step: each kind that was owed time keeps what it was owed and did not use (priced by the
        model beside the step's decodes), up to its least unit's cost (it saves for one unit it could not afford, or
        carries the remainder a whole unit left over, no more), never below 0 (time it took beyond its share was time
        nobody else wanted); a kind that no longer waits keeps nothing."""
        decodes = StepShape(shape.decode_rows, shape.decode_context_tokens)
        base = self.model.predict(decodes)
        credit = {}
        for o in owed:
            used = shape.of(o.kind)
            cost = self.model.predict(_plus(decodes, o.kind, used)) - base if used else 0.0
            left = self.credit.get(o.kind, 0.0) + o.seconds - cost
            credit[o.kind] = min(max(left, 0.0), o.unit_s)
        self.credit = credit

    def plan(self, view: StepView) -> Quota:
        if (view.decode_priority is None and self.model.ready and self.stretch is not None and view.waiting
                and self.overhead_share is not None):
            return self._quantum_plan(view)
        if view.decode_priority is None or not self.model.ready:
            # nothing to protect, or no prices yet (an engine not calibrated, in its first steps): plain budget
            # filling (a fixed target is still reported)
            fixed = self.tpot_target_s
            return replace(self.fallback.plan(view), target_s=fixed,
                           limit_s=None if fixed is None else self.limit_for(fixed))
        target = self.target_for(view.shape, view.joining)
        grants: list[Grant] = []
        shape = view.shape
        urgent = [w for w in view.waiting if w.urgency < view.decode_priority]
        held = [w for w in view.waiting if w.urgency >= view.decode_priority]
        for w in urgent:  # more urgent than every decode: not held to the objective
            grants.append(Grant(w.kind, None, None))
            shape = _plus(shape, w.kind, min(w.tokens, view.budget))
        left = view.budget - sum(min(w.tokens, view.budget) for w in urgent)
        # The one rule: the time the step has beside its decodes (a fixed T first: what it leaves; the automatic T:
        # the others' share of the step) is split among the waiting kinds by weight, each adding what the ledger
        # saved for it; then each may take what the others left, up to the step's limit.
        decodes = self.model.predict(shape)
        limit = self.limit_for(target)
        feasible = limit > decodes
        if not feasible:  # a fixed T the decodes alone break: the shares hold as under the automatic T
            limit = decodes / self.decode_share
        free = limit - decodes
        best = min((w.priority for w in held), default=0)
        weight = {w.kind: self.weights[w.kind] * 0.5 ** min(w.priority - best, 30) for w in held}
        total = sum(weight.values())
        # Under the automatic shares the chats' prompts are the chats' own time: a chat waiting to join is already a
        # decode row of T, and its prompt's weight of the others' time comes on top of T rather than out of the
        # scoring kinds' share (which they split by weight among themselves). Under a user's T every kind fits in it.
        scoring = total - weight.get(TokenKind.PREFILL, 0.0)
        chats_own = (self.tpot_target_s is None or not feasible) and scoring > 0

        def share(kind: TokenKind) -> float:
            return free * weight[kind] / (scoring if chats_own and kind is not TokenKind.PREFILL else total)

        base = self.model.predict(view.shape)
        owed = tuple(Owed(w.kind, share(w.kind), self.model.predict(_plus(view.shape, w.kind, w.least)) - base)
                     for w in held)
        owed_of = {o.kind: o for o in owed}
        if chats_own and TokenKind.PREFILL in owed_of:
            limit += owed_of[TokenKind.PREFILL].seconds
        got: dict[TokenKind, int] = {}  # tokens granted per kind, in the order the scheduler fills them
        paced_to = 0.0  # the widest cap pacing granted tokens under (reported in the step's limit)

        def take(w: Waiting, cap: float) -> int:
            nonlocal shape
            n = min(self._fit(shape, w, cap, left - sum(got.values())), w.tokens - got.get(w.kind, 0))
            if n > 0:
                shape, got[w.kind] = _plus(shape, w.kind, n), got.get(w.kind, 0) + n
            return n

        # Work past its deadline (or with none) first takes its share, those with the most saved first (a unit saved
        # for rides before the others' shares fill the step): late work is served, never starved, but no longer goes
        # before work that can still make it. Then the work still on time, earliest deadline first, takes what keeps
        # it on time at this cadence (`pace_s`), so that none of it has to take a whole chunk at once near its deadline
        # (a user's T bounds that as it bounds the lend; under the automatic target a stream waits at most one pace
        # more than the lend for it); then the rest of the step, up to `lend` (the limit, or more on the decodes'
        # slack).
        lend = self.lend_limit(view, limit)
        on_time = sorted((w for w in held if w.deadline is not None and w.deadline >= view.now),
                         key=lambda w: w.deadline)
        rest = sorted((w for w in held if w not in on_time), key=lambda w: -self.credit.get(w.kind, 0.0))
        base = self.model.predict(shape)

        def share_cap(w: Waiting) -> float:
            o = owed_of[w.kind]
            saved = o.seconds + self.credit.get(w.kind, 0.0)
            cap = min(self.model.predict(shape) + saved, max(limit, base + saved))
            if feasible and self.tpot_target_s is not None and o.unit_s <= free:
                cap = min(cap, limit)  # a user's T: held, unless the ledger saved for a unit that never fits under it
            return cap

        for w in rest:
            take(w, share_cap(w))
        paced = lend if self.tpot_target_s is not None else lend + self.pace(view.shape)
        for w in on_time:
            step = self.model.predict(shape)
            cap = min(step + self.pace_s(w, view.now, step, lend), paced)
            if take(w, cap):
                paced_to = max(paced_to, cap)
        for w in on_time:
            take(w, max(share_cap(w), lend))
        for w in held:  # work-conserving: what the others left, most urgent first
            take(w, limit)
        seats = _seats(view.free_seats, len(held)) if len(held) > 1 else None
        grants += [Grant(kind, n, seats) for kind, n in got.items()]
        # planned: work sized under the target beside the decodes (what the cadence guard judges)
        planned = bool(got) and feasible and self.model.predict(shape) <= limit * (1 + 1e-9)
        return Quota(tuple(grants), target_s=target, limit_s=max(limit, lend, paced_to), planned=planned, owed=owed)

    def quantum(self, view: StepView) -> float:
        """The time a step with no decodes is held to: the largest fixed cost of the waiting kinds' forwards over
        `overhead_share`."""
        return max(self.min_target_s, max(self._fixed_s(w, view.budget) for w in view.waiting)) / self.overhead_share

    def _fixed_s(self, w: Waiting, budget: int) -> float:
        """The fixed part of a step of `w`'s kind at the size it would run (what it waits with, up to the budget): the
        kind's forward, and the wide path's jump where that many LLM rows cross the model's narrow path (a prompt's
        chunk on a CPU pays it once a step, so chopping the chunk finer costs it again each time)."""
        n = max(1, min(w.tokens, budget))
        return self.model.predict(_plus(StepShape(), w.kind, n)) - n * self.model.token_cost_s(w.kind)

    def _quantum_plan(self, view: StepView) -> Quota:
        """No decodes to protect, deadlines on: the waiting work, most urgent priority first and earliest deadline
        first within it, takes the step up to the quantum (the fallback's budget: a step of embedding rows alone may
        be wide); the first kind takes at least its least unit when nothing else fits (never starved)."""
        budget = self.fallback.plan(view).budget or view.budget
        limit = self.quantum(view)
        order = sorted(view.waiting, key=lambda w: (w.priority, -math.inf if w.deadline is None else w.deadline,
                                                    w.arrival))
        shape, got = view.shape, {}
        for w in order:
            n = self._fit(shape, w, limit, budget - sum(got.values()))
            if not got and n == 0:
                n = min(w.least, max(0, budget))
            if n:
                shape, got[w.kind] = _plus(shape, w.kind, n), n
        seats = _seats(view.free_seats, len(got)) if len(got) > 1 else None
        return Quota(tuple(Grant(kind, n, seats) for kind, n in got.items()), budget=budget,
                     target_s=self.tpot_target_s, limit_s=limit)

    def _fit(self, shape: StepShape, w: Waiting, limit: float, budget: int) -> int:
        """Tokens of `w`'s kind under `limit` (0 when fewer than the least of it a step can take fit)."""
        n = min(self.model.tokens_within(shape, w.kind, limit), w.tokens, max(0, budget))
        return n if n >= w.least else 0


def _seats(free: int, kinds: int) -> int:
    return max(1, free // kinds)


def _plus(shape: StepShape, kind: TokenKind, tokens: int) -> StepShape:
    """`shape` with `tokens` more of `kind`."""
    return shape.with_tokens(kind, tokens)


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
        return ShareAdmission(config.scoring_share)
    target = None if config.tpot_target_ms == AUTO else config.tpot_target_ms / 1000
    return LatencyAdmission(target, model=OnlineStepTime(wide_rows=wide_rows), decode_share=config.decode_share,
                            stretch=config.deadline_stretch,
                            scoring_share=config.scoring_share, cadence=CadenceGuard() if target is not None else None)
