"""An encoder's forward in stages (one per layer), so that a row (an embedding input, a cross-encoder pair) can run a
few layers a step beside decodes and carry its hidden states to the next step. Attention is bidirectional but only
within a layer: a row's states after layer k are all layer k + 1 needs, so rows may be packed differently in every
step and the result is the whole forward's. The forward keeps nothing between steps: a row's states go out with
its result and come back with its next work (engine/staged_states.py owns them meanwhile)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# (token ids [T], token type ids [T] or None, cu_seqlens [B + 1]) -> the first stage's input [T, ...]
Begin = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor], torch.Tensor]


def _same(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True, slots=True)
class Stages:
    """A forward in `count` stages: `begin` (token ids -> the first stage's input), `run` (stages start..stop-1 of a
    packed batch), `end` (the last stage's output -> what the model gives: every token's final state, or a
    classifier's logits)."""
    count: int
    begin: Begin
    run: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]
    end: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _same


@dataclass(frozen=True, slots=True)
class StageWork:
    """What one step runs of one row: stages start..stop-1, from `state` (the row's hidden states after its stage
    start - 1, as the last step's StageResult gave them; None when start is 0: the row begins from its tokens)."""
    token_ids: list[int]
    start: int
    stop: int
    token_type_ids: list[int] | None = None
    all_tokens: bool = False  # an embedding row that wants every token's state (TEI /embed_all), not a pooled one
    state: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class StageResult:
    """What one step's stages made of one row: `output` (what `finish` gives) once its last stage ran, else `state`,
    its hidden states for its next stages (the caller keeps them: engine/staged_states.py)."""
    output: Any = None
    state: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self.state is None


# (the last stage's output of a group, its cu_seqlens, its rows' lengths, the group's work items) -> one result per
# item, in that order
Finish = Callable[[torch.Tensor, torch.Tensor, list[int], list[StageWork]], list[Any]]


class StagedForward:
    """Runs rows' stages step by step; stateless: a row's hidden states between its stages come in with its work
    (StageWork.state) and go out with its result (StageResult.state), and whoever schedules the row keeps them."""

    def __init__(self, stages: Stages, device: torch.device) -> None:
        self.stages = stages
        self.device = device

    @property
    def count(self) -> int:
        return self.stages.count

    def run(self, work: list[StageWork], finish: Finish) -> list[StageResult]:
        """Per row, the stages it has this step; rows with the same stages run packed together, longest first (the
        attention kernel batches runs of similar length). A row whose last stage ran gets `finish`'s result for it;
        the others their new hidden states."""
        return self.run_parts([(work, finish)])[0]

    @torch.inference_mode()
    def run_parts(self, parts: list[tuple[list[StageWork], Finish]]) -> list[list[StageResult]]:
        """`run` for rows of several heads over this one encoder (a cross-encoder's pairs and an embedder's inputs
        when they are the same model): rows with the same stages run packed together whatever their head, and each
        part's finished rows are finished by its own `finish`. One list of results per part, in its rows' order."""
        work = [w for rows, _ in parts for w in rows]
        part_of = [p for p, (rows, _) in enumerate(parts) for _ in rows]
        firsts = [sum(len(rows) for rows, _ in parts[:p]) for p in range(len(parts))]
        out: list[StageResult | None] = [None] * len(work)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, w in enumerate(work):
            if not 0 <= w.start < w.stop <= self.stages.count:
                raise ValueError(f"row {i}: stages {w.start}..{w.stop} of {self.stages.count}")
            if (w.start > 0) != (w.state is not None):
                raise ValueError(f"row {i}: starts at stage {w.start} "
                                 + ("without the states its earlier stages made" if w.start else "with states"))
            groups.setdefault((w.start, w.stop), []).append(i)
        for (start, stop), members in groups.items():
            members.sort(key=lambda i: -len(work[i].token_ids))
            lens = [len(work[i].token_ids) for i in members]
            cu = _cu_seqlens(lens, self.device)
            if start == 0:
                ids = torch.tensor([t for i in members for t in work[i].token_ids], dtype=torch.int64,
                                   device=self.device)
                types = None
                if any(work[i].token_type_ids is not None for i in members):  # a row without them: segment 0
                    types = torch.tensor([t for i in members for t in (work[i].token_type_ids
                                                                         or [0] * len(work[i].token_ids))],
                                         dtype=torch.int64, device=self.device)
                x = self.stages.begin(ids, types, cu)
            else:
                x = torch.cat([work[i].state for i in members])
            x = self.stages.run(x, cu, start, stop)
            if stop < self.stages.count:
                for i, part in zip(members, x.split(lens)):
                    out[i] = StageResult(state=part)
                continue
            x = self.stages.end(x, cu)
            heads = sorted({part_of[i] for i in members})
            if len(heads) == 1:
                results = parts[heads[0]][1](x, cu, lens, [work[i] for i in members])
                for i, result in zip(members, results):
                    out[i] = StageResult(result)
                continue
            states = x.split(lens)  # rows of several heads: each head finishes its own rows, packed apart
            for p in heads:
                mine = [j for j, i in enumerate(members) if part_of[i] == p]
                sub_lens = [lens[j] for j in mine]
                results = parts[p][1](torch.cat([states[j] for j in mine]), _cu_seqlens(sub_lens, self.device),
                                      sub_lens, [work[members[j]] for j in mine])
                for j, result in zip(mine, results):
                    out[members[j]] = StageResult(result)
        return [out[firsts[p]:firsts[p] + len(rows)] for p, (rows, _) in enumerate(parts)]


def _cu_seqlens(lens: list[int], device: torch.device) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lens), 0, out=cu[1:])
    return cu.to(device)
