"""`tandem serve --step-log FILE`: one JSON line per engine step (its StepRecord: when it started on the monotonic
clock, how long it took, what it served, what the latency objective predicted), for offline analysis beside
client-side timings (bench/mixed_serve.py compares a chat's token gaps with the steps between them)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from service.lifecycle import Hooks

if TYPE_CHECKING:
    from engine.outputs import StepRecord


class StepLog(Hooks):
    """Appends each step record to a file as a JSON line, written through as the step ends (line-buffered), so
    `tail -f` and a reader beside the running server see every step at once, not in blocks or at exit."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: TextIO | None = self.path.open("a", encoding="utf-8", buffering=1)

    def on_step(self, record: "StepRecord") -> None:
        if self._file is not None:
            self._file.write(json.dumps(record.flat(), separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
