"""Encoder rows' hidden states between their stages, with one owner, as the KV cache has: an embedding input or a
cross-encoder pair that runs a few layers a step (engine/models/stages.py) leaves its states here until its next
stages. The model runner takes a row's states when its next stages run and puts back what they made; the scheduler
frees a row's at the points it frees KV blocks (finish, abort, preemption), so nothing outlives its row."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.request import Sequence


class StagedStates:
    """Per encoder row part-way through its stages, its hidden states after the last stage it ran; and their bytes."""

    def __init__(self) -> None:
        self._states: dict[Sequence, torch.Tensor] = {}  # a Sequence hashes by identity
        self._bytes = 0

    def __len__(self) -> int:
        """Rows whose states are held."""
        return len(self._states)

    def __contains__(self, row: Sequence) -> bool:
        return row in self._states

    @property
    def num_bytes(self) -> int:
        """Bytes of the states held (what they occupy on the device)."""
        return self._bytes

    def put(self, row: Sequence, states: torch.Tensor) -> None:
        """Keep `row`'s states until its next stages (replacing any it had)."""
        self.free(row)
        self._states[row] = states
        self._bytes += states.nbytes

    def take(self, row: Sequence) -> torch.Tensor:
        """`row`'s states, handed over for its next stages (no longer held here)."""
        states = self._states.pop(row, None)
        if states is None:
            raise KeyError(f"no staged states for row {row.index} of request {row.request_id!r} "
                           f"(stage {row.stages_done} of {row.stages})")
        self._bytes -= states.nbytes
        return states

    def free(self, row: Sequence) -> None:
        """Drop `row`'s states, if any (it finished, was aborted, failed or was preempted)."""
        states = self._states.pop(row, None)
        if states is not None:
            self._bytes -= states.nbytes
