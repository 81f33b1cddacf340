"""One multiplexing stream (Generate or RerankStream): its live requests and the messages to send back."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from service.lifecycle import RequestLifecycle

_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class StreamSession:
    """Client ids to live requests, plus an outbox the handler drains into the stream.

    The stream ends once the client has half-closed and every request on it has
    sent its last message; a reader failure ends it at once with that error.
    """

    def __init__(self) -> None:
        self.live: dict[str, RequestLifecycle] = {}
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._input_done = False
        self._ended = False

    def send(self, message: Any) -> None:
        self._outbox.put_nowait(message)

    def finished(self, client_id: str) -> None:
        """The request sent its last message."""
        self.live.pop(client_id, None)
        self._maybe_end()

    def end_of_input(self) -> None:
        """The client half-closed: no new requests will come."""
        self._input_done = True
        self._maybe_end()

    def fail(self, error: BaseException) -> None:
        self._outbox.put_nowait(_Failure(error))

    def engine_ids(self) -> list[str]:
        return [lc.engine_id for lc in self.live.values()]

    async def messages(self) -> AsyncIterator[Any]:
        """Messages to write, in order, until the stream is done; re-raises a reader failure."""
        while True:
            item = await self._outbox.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item

    def _maybe_end(self) -> None:
        if self._input_done and not self.live and not self._ended:
            self._ended = True
            self._outbox.put_nowait(_END)
