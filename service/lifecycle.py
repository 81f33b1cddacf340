"""Per-request lifecycle records and the hooks a telemetry layer attaches to.

The bridge fills a `RequestLifecycle` as a request moves (arrival, first engine
step, first token, finish) and calls every registered `LifecycleHooks` on the
event loop. A tracing layer opens a span in `on_arrival`, adds an event in
`on_first_token`, ends it in `on_finish`, and links step spans from `on_step`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.outputs import StepRecord

CLIENT_GONE = "client_gone"  # a RequestLifecycle.metadata key: set when it was aborted because its client went away


@dataclass(slots=True)
class RequestLifecycle:
    engine_id: str  # unique in the process; what the engine and step records call the request
    client_id: str  # the id the client chose (unique per stream only)
    kind: str  # its kind's lifecycle label (service/kinds.py Kind.label: "generate", "rerank", "embed")
    arrival: float = field(default_factory=time.monotonic)  # time.monotonic() at admission
    scheduled: float | None = None  # first engine step that served it
    first_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "rejected" | "deadline"
    error: str | None = None  # status code name when it ended with an error
    error_message: str | None = None  # what it was told, when it ended with (or was refused with) an error
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0  # summed over the n completions of a generation
    completions: int = 1  # a generation's n (they decode side by side)
    documents: int = 0  # rerank: pairs to score; embed: inputs
    embedder_scored: int = 0  # rerank: documents the embedder's cosine alone scored (RerankOutput.embedder_scored)
    metadata: dict[str, str] = field(default_factory=dict)  # e.g. peer, traceparent, for exporters

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.arrival if self.first_token is not None else 0.0

    @property
    def duration_s(self) -> float:
        return (self.finished or time.monotonic()) - self.arrival


class LifecycleHooks(Protocol):
    """Called on the event loop; must not block. Implement any subset (see `Hooks`)."""

    def on_arrival(self, lc: RequestLifecycle) -> None: ...
    def on_first_token(self, lc: RequestLifecycle) -> None: ...
    def on_finish(self, lc: RequestLifecycle) -> None: ...
    def on_refused(self, lc: RequestLifecycle) -> None: ...
    def on_step(self, record: "StepRecord") -> None: ...


class Hooks:
    """A do-nothing base for LifecycleHooks implementations."""

    def on_arrival(self, lc: RequestLifecycle) -> None:
        pass

    def on_first_token(self, lc: RequestLifecycle) -> None:
        pass

    def on_finish(self, lc: RequestLifecycle) -> None:
        pass

    def on_refused(self, lc: RequestLifecycle) -> None:
        """A request answered with an error before the engine admitted it (no on_arrival came first)."""

    def on_step(self, record: "StepRecord") -> None:
        pass
