"""The events of admitted generations on their way to a reader, bounded: a `GenerationStream` is one of the two places
a stream's unread responses may wait (the other: the gRPC door's StreamSession), with one overflow path."""
from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from engine.outputs import TokenDelta
from service.core_types import GenerateEvent, Usage
from service.errors import ErrorKind, ServiceError
from service.lifecycle import CLIENT_GONE, RequestLifecycle

if TYPE_CHECKING:
    from service.bridge import EngineBridge


class GenerationStream:
    """The events of one or more admitted generations, in the order the engine produced them; ends when every
    input has sent its last event. `abort()` stops whatever is still running (its last event still arrives).

    The engine never waits for a reader, so events queue here until read, bounded: when the unread events exceed
    `max_buffer_bytes` (their size as text, tokens and log-probabilities), every request of the stream is aborted
    (its KV blocks freed), what was queued is dropped, and each unfinished input ends with RESOURCE_EXHAUSTED.

    A stream is bounded in one place only. With `max_buffer_bytes` None this one counts nothing: its reader moves
    each event on as it arrives into a bounded channel of its own, which is then the stream's only buffer and its
    overflow the only overflow (the gRPC door's StreamSession, one per gRPC stream, whatever its requests). Events
    wait here then only between the engine's hand-off and the reader's next turn on the loop (one step's worth)."""

    def __init__(self, bridge: "EngineBridge", max_buffer_bytes: int | None) -> None:
        self._bridge = bridge
        self._max_bytes = max_buffer_bytes
        self._events: deque[tuple[GenerateEvent, int]] = deque()
        self._buffered = 0
        self._wakeup = asyncio.Event()
        self._lifecycles: list[RequestLifecycle] = []
        self._ids: list[str] = []
        self._read_last: set[int] = set()  # inputs whose last event was read
        self._overflowed = False

    def sink(self, index: int, request_id: str):
        """The bridge's sink for input `index`: TokenDeltas and the ServiceError that may end it."""
        def put(event: TokenDelta | ServiceError) -> None:
            if self._overflowed:
                return
            if isinstance(event, ServiceError):
                item = GenerateEvent(index, request_id, error=event, usage=Usage.of(self._lifecycles[index]))
            elif event.finished:
                item = GenerateEvent(index, request_id, event, usage=Usage.of(self._lifecycles[index]))
            else:
                item = GenerateEvent(index, request_id, event)
            size = 0 if self._max_bytes is None else _size(item)
            if size and self._events and self._buffered + size > self._max_bytes:
                self._overflow()
                return
            self._events.append((item, size))
            self._buffered += size
            self._wakeup.set()
        return put

    def _admitted(self, request_id: str, lc: RequestLifecycle) -> None:
        self._ids.append(request_id)
        self._lifecycles.append(lc)

    def _overflow(self) -> None:
        self._overflowed = True
        dropped = len(self._events)
        self._events.clear()
        self._buffered = 0
        error = ServiceError(ErrorKind.RESOURCE_EXHAUSTED,
                             f"stream buffer full: the client did not read {dropped} queued responses (over "
                             f"{self._max_bytes} bytes, --max-stream-buffer-bytes); its requests were cancelled. "
                             "Read responses as they come")
        for index, request_id in enumerate(self._ids):
            if index not in self._read_last:
                self._events.append((GenerateEvent(index, request_id, error=error), 0))
        self.abort()
        self._wakeup.set()

    @property
    def ids(self) -> list[str]:
        """Each input's one request id (new_request_id), input order."""
        return [lc.engine_id for lc in self._lifecycles]

    def abort(self, *, client_gone: bool = False) -> None:
        """Stop what still runs; `client_gone`: because its client went away (the access log says 499 / CANCELLED,
        not the status of an answer nobody read)."""
        for lc in self._lifecycles:
            if client_gone:
                lc.metadata[CLIENT_GONE] = "1"
            self._bridge.abort(lc.engine_id)

    @property
    def done(self) -> bool:
        """Every input's last event was read."""
        return len(self._read_last) == len(self._ids)

    def __aiter__(self) -> "GenerationStream":
        return self

    async def __anext__(self) -> GenerateEvent:
        while not self._events:
            if len(self._read_last) == len(self._ids):
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()
        event, size = self._events.popleft()
        self._buffered -= size
        if event.last:
            self._read_last.add(event.index)
        return event


def _size(event: GenerateEvent) -> int:
    """Roughly what the event costs to hold and send: its text, tokens and log-probability entries."""
    out = event.output
    if out is None:
        return 64
    entries = sum(len(lp) for lp in out.logprobs or ()) + sum(len(lp or ()) for lp in out.prompt_logprobs or ())
    return 64 + len(out.text) + 8 * len(out.new_token_ids) + 16 * entries
