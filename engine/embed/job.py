"""One embedding request in flight: its inputs, one encoder row per input, vectors as they arrive."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EmbedParams
from engine.request import Sequence


@dataclass(slots=True, eq=False)
class EmbedJob:
    request_id: str
    params: EmbedParams
    arrival_time: float
    rows: list[Sequence] = field(default_factory=list)  # one per input, input order (Sequence.index)
    vectors: list[list[float] | None] = field(default_factory=list)  # engine.py fills them as rows run
    remaining: int = 0
    truncated: list[bool] = field(default_factory=list)  # per input: cut to the embedder's limit

    @property
    def prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.rows)
