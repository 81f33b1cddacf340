"""How `tandem serve` ended, for its last log line: the requests a stop signal found live or that arrived during the
drain grace, split into those that finished (drained) and those that did not (aborted: by the drain timeout, a
second signal, their client, or the engine)."""
from __future__ import annotations

from service.lifecycle import Hooks, RequestLifecycle


class ShutdownTally(Hooks):
    """A lifecycle observer that counts finished requests once `start()` is called (at the first stop signal)."""

    def __init__(self) -> None:
        self.counting = False
        self.drained = 0
        self.aborted = 0

    def start(self) -> None:
        self.counting = True

    def on_finish(self, lc: RequestLifecycle) -> None:
        if not self.counting:
            return
        if lc.finish_reason in ("stop", "length"):
            self.drained += 1
        else:
            self.aborted += 1

    def summary(self, how: str) -> str:
        return (f"tandem serve stopped ({how}): drained {self.drained} request{'s' * (self.drained != 1)}, "
                f"aborted {self.aborted}")
