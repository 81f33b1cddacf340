"""Admission policies: how the token budget and seats a step has left after decodes and prefill chunks are split
between waiting prompts and waiting rerank pairs. The scheduler is given one; it never hard-wires a split."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

from engine.batch import Batch

# admit(max_tokens, max_seats) -> tokens admitted; None: no limit but the step's own
Admit = Callable[[int | None, int | None], int]


@dataclass(slots=True)
class AdmissionStep:
    """What a policy sees of one step, and the two calls it makes. Each admit call takes from the head of its
    queue (priority, then FIFO) while the tokens and seats last, and lowers `budget` by what it admitted."""
    batch: Batch  # decodes and prefill chunks already scheduled this step
    budget: int  # tokens left in this step
    free_seats: int  # sequences that may still join the running set
    generation_waiting: int
    rerank_waiting: int
    rerank_head_tokens: int  # tokens of the rerank pair that would be admitted next (0: none)
    _admit_generation: Admit = field(repr=False)
    _admit_rerank: Admit = field(repr=False)

    def admit_generation(self, max_tokens: int | None = None, max_seats: int | None = None) -> int:
        return self._take(self._admit_generation, max_tokens, max_seats)

    def admit_rerank(self, max_tokens: int | None = None, max_seats: int | None = None) -> int:
        return self._take(self._admit_rerank, max_tokens, max_seats)

    def _take(self, admit: Admit, max_tokens: int | None, max_seats: int | None) -> int:
        limit = self.budget if max_tokens is None else min(max_tokens, self.budget)
        used = admit(limit, max_seats) if limit > 0 else 0
        self.budget -= used
        return used


class AdmissionPolicy(ABC):
    @abstractmethod
    def admit(self, step: AdmissionStep) -> None:
        """Admit waiting work into `step.batch` through step.admit_generation / step.admit_rerank."""


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
