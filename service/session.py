"""One multiplexing stream (Generate or RerankStream): its live requests and the messages to send back."""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, AsyncIterator, Callable


from service.core import DEFAULT_MAX_BUFFER_BYTES
from service.errors import ErrorKind, ServiceError

_END = object()
_MESSAGE_OVERHEAD = 64  # bytes counted per queued message on top of its serialized size (the Python object)


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class StreamSession:
    """Client ids to live requests, plus an outbox the handler drains into the stream.

    The stream ends once the client has half-closed and every request on it has
    sent its last message; a reader failure ends it at once with that error.

    The outbox is bounded: the engine thread never waits for a client, so a
    client that stops reading would otherwise grow it without limit. When the
    messages queued and not yet taken by the stream exceed `max_buffer_bytes`
    (serialized size, plus a small per-message overhead; one message always
    fits), the stream fails with RESOURCE_EXHAUSTED: what was queued is dropped,
    every live request on the stream is aborted (its `live` abort, freeing its
    KV blocks), and the client gets that status as soon as it reads again
    (or its stream is cancelled if it went away). Other streams are untouched.
    """

    def __init__(self, max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES) -> None:
        if max_buffer_bytes < 1:
            raise ValueError(f"max_buffer_bytes must be >= 1, got {max_buffer_bytes}")
        self.live: dict[str, Callable[[], None]] = {}  # client id -> what stops that request (once)
        self.max_buffer_bytes = max_buffer_bytes
        self.buffered_bytes = 0
        self.overflowed = False
        self._aborted: set[str] = set()
        self._outbox: deque = deque()  # (item, size)
        self._wakeup = asyncio.Event()
        self._unsent = 0  # messages queued and not yet written by the stream (the one being written counts)
        self._all_sent = asyncio.Event()
        self._all_sent.set()
        self._input_done = False
        self._ended = False

    def send(self, message: Any) -> None:
        if self.overflowed:  # the stream is failing: nobody will read this; stop what produced it
            self._abort_request(message.request_id)
            return
        size = message.ByteSize() + _MESSAGE_OVERHEAD
        if self._outbox and self.buffered_bytes + size > self.max_buffer_bytes:
            self._overflow()
            return
        self._put(message, size)

    def finished(self, client_id: str) -> None:
        """The request sent its last message."""
        self.live.pop(client_id, None)
        self._aborted.discard(client_id)
        self._maybe_end()

    def end_of_input(self) -> None:
        """The client half-closed: no new requests will come."""
        self._input_done = True
        self._maybe_end()

    def fail(self, error: BaseException) -> None:
        self._put(_Failure(error), 0)

    def abort_all(self) -> None:
        """Stop every live request on the stream (the client went away or the stream ended)."""
        for client_id in list(self.live):
            self._abort_request(client_id)

    async def messages(self) -> AsyncIterator[Any]:
        """Messages to write, in order, until the stream is done; re-raises a reader failure. A message counts
        as sent once the writer asks for the next one (it has written this one)."""
        while True:
            while not self._outbox:
                self._wakeup.clear()
                await self._wakeup.wait()
            item, size = self._outbox.popleft()
            self.buffered_bytes -= size
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
            self._sent_one()

    async def all_sent(self) -> None:
        """Return once every message queued so far has been written to the stream."""
        await self._all_sent.wait()

    def closed(self) -> None:
        """The stream is over (written out, failed or cancelled): nothing queued will be written any more."""
        self._unsent = 0
        self._all_sent.set()

    def _sent_one(self) -> None:
        self._unsent -= 1
        if self._unsent <= 0:
            self._all_sent.set()

    def _put(self, item: Any, size: int) -> None:
        if item is not _END and not isinstance(item, _Failure):
            self._unsent += 1
            self._all_sent.clear()
        self._outbox.append((item, size))
        self.buffered_bytes += size
        self._wakeup.set()

    def _overflow(self) -> None:
        self.overflowed = True
        queued = len(self._outbox)
        self._outbox.clear()
        self.closed()  # what was queued is dropped, never written
        self.buffered_bytes = 0
        self._put(_Failure(ServiceError(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"stream buffer full: the client did not read {queued} queued responses "
            f"(over {self.max_buffer_bytes} bytes, --max-stream-buffer-bytes); every request on this stream "
            "was cancelled. Read responses as they come, or spread requests over more streams")), 0)
        for client_id in list(self.live):
            self._abort_request(client_id)

    def _abort_request(self, client_id: str | None) -> None:
        abort = self.live.get(client_id)
        if abort is not None and client_id not in self._aborted:
            self._aborted.add(client_id)
            abort()

    def _maybe_end(self) -> None:
        if self._input_done and not self.live and not self._ended:
            self._ended = True
            self._put(_END, 0)
