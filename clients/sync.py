"""Client: the blocking wrapper; an AsyncClient runs on a private event loop in a background thread."""
from __future__ import annotations

import asyncio
import functools
import queue
import threading
from typing import Any, Callable, Iterator, Sequence

from clients.aio import AsyncClient
from clients.types import Delta

_DONE = object()


class _Raised:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Client:
    """Blocking tandem client: `with Client("localhost:50051") as c: for d in c.generate("Hi"): ...`.

    Thread-safe: calls from several threads share one channel and one Generate stream.
    Leaving a generate() loop early cancels the request on the server. Its calls that answer once (complete,
    rerank, embed, classify, embed_sparse, model_info: AsyncClient.ONE_SHOT) take AsyncClient's arguments.
    """

    def __init__(self, target: str = "localhost:50051", **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-client", daemon=True)
        self._thread.start()
        self._client: AsyncClient = self._run(_make(target, kwargs))

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(_shutdown(self._client))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Iterator[Delta]:
        """Same arguments as AsyncClient.generate; yields Delta objects as they arrive."""
        items: queue.SimpleQueue = queue.SimpleQueue()

        async def pump() -> None:
            try:
                async for delta in self._client.generate(prompt, **kwargs):
                    items.put(delta)
                items.put(_DONE)
            except BaseException as exc:  # CancelledError included: the consumer is gone then anyway
                items.put(_Raised(exc))
                raise

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                item = items.get()
                if item is _DONE:
                    return
                if isinstance(item, _Raised):
                    raise item.error
                yield item
        finally:
            if not future.done():
                future.cancel()  # the async generator's cleanup sends the cancel

    def chat(self, messages: Sequence[dict], **kwargs: Any) -> Iterator[Delta]:
        return self.generate(messages=messages, **kwargs)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


def _blocking(name: str) -> Callable[..., Any]:
    """Client's method `name`: AsyncClient's of that name (same arguments, same answer), run to its end."""
    call = getattr(AsyncClient, name)

    @functools.wraps(call)
    def method(self: Client, *args: Any, **kwargs: Any) -> Any:
        return self._run(getattr(self._client, name)(*args, **kwargs))
    return method


for _name in AsyncClient.ONE_SHOT:  # complete, rerank, embed, classify, embed_sparse, model_info
    setattr(Client, _name, _blocking(_name))


async def _shutdown(client: AsyncClient) -> None:
    """Close the client and let grpc's own pending tasks finish before the loop stops."""
    await client.close()
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _make(target: str, kwargs: dict) -> AsyncClient:
    return AsyncClient(target, **kwargs)
