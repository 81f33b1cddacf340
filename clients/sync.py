"""Client: the blocking wrapper; an AsyncClient runs on a private event loop in a background thread."""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Iterator, Sequence

from clients.aio import AsyncClient
from clients.types import Delta, RerankResults
from proto import tandem_pb2 as pb

_DONE = object()


class _Raised:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Client:
    """Blocking tandem client: `with Client("localhost:50051") as c: for d in c.generate("Hi"): ...`.

    Thread-safe: calls from several threads share one channel and one Generate stream.
    Leaving a generate() loop early cancels the request on the server.
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

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Delta:
        return self._run(self._client.complete(prompt, **kwargs))

    def rerank(self, query: str, documents: Sequence[str], **kwargs: Any) -> RerankResults:
        """Same arguments as AsyncClient.rerank: results sorted by score with .index, .score, .document."""
        return self._run(self._client.rerank(query, documents, **kwargs))

    def embed(self, texts: str | Sequence[str], **kwargs: Any) -> list[list[float]]:
        """Same arguments as AsyncClient.embed: one vector per text, input order."""
        return self._run(self._client.embed(texts, **kwargs))

    def classify(self, texts: str | Sequence[str] | Sequence[tuple[str, str]], **kwargs: Any
                 ) -> list[dict[str, float]]:
        """Same arguments as AsyncClient.classify: per text (or text pair), each label's probability."""
        return self._run(self._client.classify(texts, **kwargs))

    def embed_sparse(self, texts: str | Sequence[str], **kwargs: Any) -> list[dict[int, float]]:
        """Same arguments as AsyncClient.embed_sparse: per text, its sparse vector {vocabulary id: weight}."""
        return self._run(self._client.embed_sparse(texts, **kwargs))

    def model_info(self) -> pb.ModelInfoResponse:
        return self._run(self._client.model_info())

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


async def _shutdown(client: AsyncClient) -> None:
    """Close the client and let grpc's own pending tasks finish before the loop stops."""
    await client.close()
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _make(target: str, kwargs: dict) -> AsyncClient:
    return AsyncClient(target, **kwargs)
