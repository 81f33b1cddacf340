"""The decodes' cadence against the latency objective: how far a policy may plan its steps.

A latency policy plans each step so that its predicted time, with the step-time model's error margin, stays under the
target. What a chat sees is not the predicted time but the time between two of its tokens: the step itself, whatever
the model did not foresee (another process on the same cores, a cache-cold weight pass), and the engine's own time
between steps. `CadenceGuard` watches that interval for every step that carried decodes and work the policy chose to
plan beside them, and keeps the share of those intervals over the target at `exceed` (0.01: the target is the p99)
by scaling the limit the policy plans to: each interval over the target cuts the scale by `cut`, each one within it
raises the scale by cut x exceed / (1 - exceed), so the scale settles where the share of intervals over the target is
`exceed` (a quantile tracked by stochastic approximation). Steps that hold only decodes, or a unit of other work that never fits under the target
and rode on its saved share, do not move it: no plan made them, and a smaller plan would not make them shorter.

The scale stays in [min_scale, 1]: never above the model's own plan, and never so low that planned work stops.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CadenceGuard:
    target_s: float | None = None  # None: each step's own target (observe's target_s; the automatic objective)
    exceed: float = 0.01  # the share of planned decode intervals allowed over the target
    cut: float = 0.05  # relative cut of the scale per interval over the target
    min_scale: float = 0.5

    scale: float = field(default=1.0, init=False)
    over: int = field(default=0, init=False)  # planned intervals over the target so far
    planned: int = field(default=0, init=False)  # planned intervals so far
    _last_end: float | None = field(default=None, init=False, repr=False)  # end of the previous step with decodes

    def __post_init__(self) -> None:
        if self.target_s is not None and not self.target_s > 0:
            raise ValueError(f"target_s must be > 0, got {self.target_s!r}")
        if not 0.0 < self.exceed < 1.0:
            raise ValueError(f"exceed must be in (0, 1), got {self.exceed!r}")
        if not 0.0 < self.cut < 1.0:
            raise ValueError(f"cut must be in (0, 1), got {self.cut!r}")
        if not 0.0 < self.min_scale <= 1.0:
            raise ValueError(f"min_scale must be in (0, 1], got {self.min_scale!r}")

    def interval(self, start: float, duration_s: float) -> float:
        """The time a decode of this step waited for its token: from the previous decode step's end (the engine's
        time between steps included), or the step alone when the previous step had no decodes."""
        end = start + duration_s
        return end - self._last_end if self._last_end is not None else duration_s

    def observe(self, start: float, duration_s: float, decodes: bool, planned: bool,
                target_s: float | None = None) -> None:
        """One step: when it started and lasted (the engine's monotonic clock), whether decodes rode in it, whether
        the policy planned work beside them (within the target), and the target it planned to (None: the
        guard's own)."""
        target = self.target_s if target_s is None else target_s
        if decodes and planned and target is not None:
            self.planned += 1
            if self.interval(start, duration_s) > target:
                self.over += 1
                self.scale = max(self.min_scale, self.scale * (1.0 - self.cut))
            else:
                self.scale = min(1.0, self.scale * (1.0 + self.cut * self.exceed / (1.0 - self.exceed)))
        self._last_end = start + duration_s if decodes else None
