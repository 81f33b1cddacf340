"""AsyncClient: generations multiplexed over one shared Generate stream, reranks with retries."""
from __future__ import annotations

import asyncio
import hashlib
import random
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Sequence

import grpc

from clients.params import sampling_params
from clients.types import Completion, Delta, RerankResult, RerankResults, TandemError, Usage, status_code
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc


class _SharedStream:
    """One open Generate call: a send queue feeding it and a reader routing replies by request id.

    Behind a load balancer a stream lives on one replica (`replica`, from the x-tandem-replica metadata).
    A retired stream takes no new requests and half-closes once its last request is done.
    """

    def __init__(self, stub: pb_grpc.TandemStub, metadata: tuple) -> None:
        self._outgoing: asyncio.Queue = asyncio.Queue()
        self._routes: dict[str, asyncio.Queue] = {}
        self.closed = False
        self.retired = False
        self.replica: str | None = None
        self._closing = False
        self._call = stub.Generate(self._requests(), metadata=metadata)
        self._reader = asyncio.create_task(self._read())

    def register(self, request_id: str) -> asyncio.Queue:
        self._routes[request_id] = queue = asyncio.Queue()
        return queue

    def unregister(self, request_id: str) -> None:
        self._routes.pop(request_id, None)
        if self.retired and not self._routes:
            self._outgoing.put_nowait(None)  # half-close: the server ends the stream

    def retire(self) -> None:
        self.retired = True
        if not self._routes:
            self._outgoing.put_nowait(None)

    def send(self, message: pb.GenerateClientMessage) -> None:
        if not self.closed:
            self._outgoing.put_nowait(message)

    async def close(self) -> None:
        self._closing = True
        self._outgoing.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()

    async def _requests(self) -> AsyncIterator[pb.GenerateClientMessage]:
        while True:
            message = await self._outgoing.get()
            if message is None:
                return
            yield message

    async def _read(self) -> None:
        error = TandemError(grpc.StatusCode.UNAVAILABLE, "the Generate stream ended before this request finished")
        try:
            self.replica = dict(await self._call.initial_metadata() or ()).get("x-tandem-replica")
            async for message in self._call:
                queue = self._routes.get(message.request_id)
                if queue is not None:
                    queue.put_nowait(message)
        except grpc.aio.AioRpcError as exc:
            error = TandemError.from_rpc(exc)
            if exc.code() is grpc.StatusCode.CANCELLED and not self._closing:
                # Not our cancel: a proxy reset the stream because its replica went away (HAProxy sends
                # RST_STREAM(CANCEL) when the server connection dies).
                error = TandemError(grpc.StatusCode.UNAVAILABLE,
                                    f"the Generate stream was reset on the server side (replica gone?): "
                                    f"{exc.details()}")
        except asyncio.CancelledError:
            error = TandemError(grpc.StatusCode.CANCELLED, "the client closed the stream")
            raise
        finally:
            self.closed = True
            self._outgoing.put_nowait(None)
            for queue in self._routes.values():
                queue.put_nowait(error)


class AsyncClient:
    """Async tandem client. Create and use it inside one event loop.

    `generate` yields Delta objects; leaving the loop early (break, exception,
    task cancellation) cancels the request on the server. `rerank` retries
    UNAVAILABLE with exponential backoff and jitter; `generate` retries it only
    while nothing has streamed yet (a draining replica refused it, or its
    stream broke), never once text has been yielded.

    Routing (scale-out): every request carries gRPC metadata `x-tandem-prefix`,
    a short hash of what the next request will share (a chat's system prompt
    and first user turn; a rerank query and instruction), so a load balancer
    hashing it sends the request to the replica whose prefix cache holds it.
    Pass `routing_key=` to choose the key, or `routing_key=""` to send none.
    Generations share one Generate stream per key (up to `max_streams`).
    """

    # The calls that answer once (a coroutine each): the blocking Client has each of them under the same name, with
    # the same arguments (clients/sync.py), so a new call is written here once and named here.
    ONE_SHOT = ("complete", "rerank", "embed", "classify", "embed_sparse", "model_info")

    def __init__(self, target: str = "localhost:50051", *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, options: Sequence[tuple[str, Any]] = (),
                 max_retries: int = 4, backoff_s: float = 0.1, max_backoff_s: float = 2.0,
                 retry_codes: Sequence[grpc.StatusCode] = (grpc.StatusCode.UNAVAILABLE,),
                 max_streams: int = 64) -> None:
        self.target = target
        self._metadata: tuple = (("authorization", f"Bearer {token}"),) if token else ()
        self._tls = tls or root_certificates is not None
        self._root_certificates = root_certificates
        # Rerank responses with return_documents can pass grpc's default 4 MiB receive limit; the server bounds them.
        self._options = [("grpc.max_receive_message_length", -1), *options]
        self._max_retries = max_retries
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._retry_codes = tuple(retry_codes)
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.TandemStub | None = None
        self._streams: OrderedDict[str, _SharedStream] = OrderedDict()  # routing key -> stream, LRU order
        self._owner: dict[str, _SharedStream] = {}  # live request id -> its stream
        self._max_streams = max(1, max_streams)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; the server cancels whatever was still running on it."""
        streams = {*self._streams.values(), *self._owner.values()}
        self._streams.clear()
        self._owner.clear()
        for stream in streams:
            await stream.close()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    @property
    def stub(self) -> pb_grpc.TandemStub:
        if self._stub is None:
            if self._tls:
                creds = grpc.ssl_channel_credentials(root_certificates=self._root_certificates)
                self._channel = grpc.aio.secure_channel(self.target, creds, options=self._options)
            else:
                self._channel = grpc.aio.insecure_channel(self.target, options=self._options)
            self._stub = pb_grpc.TandemStub(self._channel)
        return self._stub

    def _shared_stream(self, key: str) -> _SharedStream:
        """The open Generate stream for a routing key ("" for none), opening one if needed."""
        stream = self._streams.get(key)
        if stream is not None and not stream.closed and not stream.retired:
            self._streams.move_to_end(key)
            return stream
        self._streams.pop(key, None)
        while len(self._streams) >= self._max_streams:
            self._streams.popitem(last=False)[1].retire()  # least recently used
        metadata = self._metadata + ((("x-tandem-prefix", key),) if key else ())
        stream = self._streams[key] = _SharedStream(self.stub, metadata)
        return stream

    # ---- generation ------------------------------------------------------------------------------

    async def generate(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
                       token_ids: Sequence[int] | None = None, model: str = "", timeout: float | None = None,
                       request_id: str | None = None, routing_key: str | None = None,
                       **params: Any) -> AsyncIterator[Delta]:
        """Stream one generation. Give exactly one of prompt, messages (chat) or token_ids.

        params: the sampling keywords of `clients.params.sampling_params` (vLLM's names: max_tokens, temperature,
        top_p, top_k, seed, stop, stop_token_ids, ignore_eos, priority, n, logprobs, prompt_logprobs,
        repetition_penalty, presence_penalty, frequency_penalty, min_p, min_tokens, logit_bias, json_schema,
        regex, choice); unset ones take the server's defaults. With n > 1 the deltas of the n completions
        interleave, told apart by `Delta.index`; `Delta.logprobs` / `Delta.prompt_logprobs` are filled when asked.

        max_windows: a document longer than the reranker's window is scored as up to this many overlapping windows,
        its score the best window's (`.windows` on each result says how many); None: the server's setting.
        routing_key: sent as x-tandem-prefix (default: for messages, a hash of the system prompt and first user
        turn, which every later turn of the chat shares; for a prompt or token ids, none).

        timeout (seconds) becomes the request's server-side timeout_ms: past it the server aborts the work and
        this raises TandemError(DEADLINE_EXCEEDED). Refusals raise TandemError with the server's code and message.
        """
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use on this client")
        request = _generate_request(request_id, prompt, messages, token_ids, model, timeout, sampling_params(**params))
        key = chat_routing_key(messages) if routing_key is None and messages is not None else (routing_key or "")
        delay = self._backoff_s
        for attempt in range(self._max_retries + 1):
            stream = self._shared_stream(key)
            replies = stream.register(request_id)
            self._owner[request_id] = stream
            done = streamed = False
            error: TandemError | None = None
            try:
                stream.send(pb.GenerateClientMessage(request=request))
                while not done:
                    reply = await replies.get()
                    if isinstance(reply, TandemError):  # the whole stream ended
                        done, error = True, reply
                        break
                    kind = reply.WhichOneof("kind")
                    if kind in ("delta", "final"):
                        streamed, done = True, kind == "final"
                        yield Delta.from_proto(request_id, getattr(reply, kind), stream.replica, final=done)
                    else:
                        done, error = True, TandemError(status_code(reply.error.code), reply.error.message)
            finally:
                if not done:
                    stream.send(pb.GenerateClientMessage(cancel=pb.CancelRequest(request_id=request_id)))
                self._owner.pop(request_id, None)
                stream.unregister(request_id)
            if error is None:
                return
            if error.code is grpc.StatusCode.UNAVAILABLE:
                stream.retire()  # its replica is draining or gone: the next stream may land elsewhere
            if streamed or error.code not in self._retry_codes or attempt == self._max_retries:
                raise TandemError(error.code, error.message, request_id)
            await asyncio.sleep(min(delay, self._max_backoff_s) * random.uniform(0.5, 1.5))
            delay *= 2

    def chat(self, messages: Sequence[dict], **kwargs) -> AsyncIterator[Delta]:
        """generate() with chat messages ({"role": ..., "content": ...}), rendered by the model's template."""
        return self.generate(messages=messages, **kwargs)

    async def complete(self, prompt: str | None = None, **kwargs) -> Delta:
        """Run a generation to the end: one Delta with completion 0's whole text, token ids, finish reason and
        logprobs, the request's usage and prompt_logprobs, and `.outputs`: every completion, index order."""
        deltas = [delta async for delta in self.generate(prompt, **kwargs)]
        outputs = [_gather(index, [d for d in deltas if d.index == index])
                   for index in sorted({d.index for d in deltas})]
        first, last = outputs[0], deltas[-1]
        return Delta(last.request_id, first.text, first.token_ids, first.finish_reason, last.usage, last.replica,
                     first.index, first.logprobs, next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None),
                     outputs)

    def cancel(self, request_id: str) -> None:
        """Ask the server to stop a running generation; its generate() then ends with finish_reason "abort"."""
        stream = self._owner.get(request_id)
        if stream is not None:
            stream.send(pb.GenerateClientMessage(cancel=pb.CancelRequest(request_id=request_id)))

    # ---- rerank ----------------------------------------------------------------------------------

    async def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None,
                     return_documents: bool = False, truncate: str = "end", instruction: str | None = None,
                     priority: int = 0, model: str = "", timeout: float | None = None,
                     routing_key: str | None = None, max_windows: int | None = None) -> RerankResults:
        """Scores sorted highest first (.index into documents, .score, .document if return_documents).

        routing_key: sent as x-tandem-prefix (default: a hash of instruction and query, so later batches of
        documents for the same query reach the replica that has its prefix cached; "" sends none).
        `.replica` on the results names the replica that served it, `.mode` the rerank mode and `.model` the model that
        scored them.
        """
        if truncate not in ("end", "none"):
            raise ValueError(f"truncate must be 'end' or 'none', got {truncate!r}")
        request = pb.RerankRequest(query=query, documents=list(documents), top_n=top_n,
                                   return_documents=return_documents, instruction=instruction, priority=priority,
                                   model=model, truncate=pb.TRUNCATE_NONE if truncate == "none" else pb.TRUNCATE_END,
                                   max_windows=max_windows)
        key = prefix_key(instruction or "", query) if routing_key is None else routing_key
        metadata = self._metadata + ((("x-tandem-prefix", key),) if key else ())

        async def call(remaining: float | None) -> tuple[pb.RerankResponse, str | None]:
            rpc = self.stub.Rerank(request, timeout=remaining, metadata=metadata)
            response = await rpc
            return response, dict(await rpc.initial_metadata() or ()).get("x-tandem-replica")

        response, replica = await self._with_retries(call, timeout)
        results = RerankResults(RerankResult(r.index, r.score, r.document if r.HasField("document") else None,
                                             r.document_tokens, r.truncated, r.windows or 1)
                                for r in response.results)
        results.usage = Usage.from_proto(response.usage)
        results.replica = replica
        results.mode = response.mode
        results.model = response.model
        return results

    async def embed(self, texts: str | Sequence[str], *, normalize: bool = True, dimensions: int | None = None,
                    truncate: str = "end", priority: int = 0, model: str = "",
                    timeout: float | None = None) -> list[list[float]]:
        """One vector per text, input order, from the server's embedding model (L2-normalised unless told
        otherwise). truncate: "end" or "start" cuts a text over the model's limit there, "none" refuses it;
        dimensions: the first N values, for Matryoshka models only."""
        if truncate not in ("end", "start", "none"):
            raise ValueError(f"truncate must be 'end', 'start' or 'none', got {truncate!r}")
        request = pb.EmbedRequest(texts=[texts] if isinstance(texts, str) else list(texts), model=model,
                                  normalize=normalize, dimensions=dimensions, priority=priority,
                                  truncate=pb.TRUNCATE_NONE if truncate == "none" else pb.TRUNCATE_END,
                                  truncate_start=truncate == "start")
        response = await self._with_retries(lambda remaining: self.stub.Embed(
            request, timeout=remaining, metadata=self._metadata), timeout)
        return [list(e.values) for e in response.embeddings]

    async def classify(self, texts: str | Sequence[str] | Sequence[tuple[str, str]], *, raw_scores: bool = False,
                       truncate: str = "end", priority: int = 0, model: str = "",
                       timeout: float | None = None) -> list[dict[str, float]]:
        """Per text, input order, each label's probability (the logits with raw_scores) from the server's classifier
        (tandem serve --classifier); texts may instead be text pairs, (text, text_pair), each one input encoded as a
        pair (NLI, cross-encoder classifiers); truncate: "end" cuts an input over the model's limit, "none" refuses
        it."""
        if truncate not in ("end", "none"):
            raise ValueError(f"truncate must be 'end' or 'none', got {truncate!r}")
        inputs = [texts] if isinstance(texts, str) else list(texts)
        pairs = [pb.TextPair(text=a, text_pair=b) for a, b in inputs] if inputs and not isinstance(inputs[0], str) \
            else []
        request = pb.ClassifyRequest(texts=[] if pairs else inputs, pairs=pairs, model=model,
                                     raw_scores=raw_scores, priority=priority,
                                     truncate=pb.TRUNCATE_NONE if truncate == "none" else pb.TRUNCATE_END)
        response = await self._with_retries(lambda remaining: self.stub.Classify(
            request, timeout=remaining, metadata=self._metadata), timeout)
        return [{s.label: s.score for s in r.scores} for r in response.results]

    async def embed_sparse(self, texts: str | Sequence[str], *, truncate: str = "end", priority: int = 0,
                           model: str = "", timeout: float | None = None) -> list[dict[int, float]]:
        """Per text, input order, its SPLADE sparse vector ({vocabulary id: weight}, non-zero only) from the
        server's sparse embedder (tandem serve --sparse-embedder)."""
        request = pb.EmbedSparseRequest(texts=[texts] if isinstance(texts, str) else list(texts), model=model,
                                        priority=priority,
                                        truncate=pb.TRUNCATE_NONE if truncate == "none" else pb.TRUNCATE_END)
        response = await self._with_retries(lambda remaining: self.stub.EmbedSparse(
            request, timeout=remaining, metadata=self._metadata), timeout)
        return [dict(zip(e.indices, e.values)) for e in response.embeddings]

    async def model_info(self) -> pb.ModelInfoResponse:
        return await self._with_retries(lambda remaining: self.stub.ModelInfo(
            pb.ModelInfoRequest(), timeout=remaining, metadata=self._metadata), None)

    async def _with_retries(self, call, timeout: float | None):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout is not None else None
        delay = self._backoff_s
        for attempt in range(self._max_retries + 1):
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                return await call(remaining)
            except grpc.aio.AioRpcError as exc:
                pause = min(delay, self._max_backoff_s) * random.uniform(0.5, 1.5)
                out_of_time = deadline is not None and loop.time() + pause >= deadline
                if exc.code() not in self._retry_codes or attempt == self._max_retries or out_of_time:
                    raise TandemError.from_rpc(exc) from None
                await asyncio.sleep(pause)
                delay *= 2
        raise AssertionError("unreachable")


def prefix_key(*parts: str) -> str:
    """A short hash of what requests share (x-tandem-prefix): a load balancer hashes it to pick a replica."""
    return hashlib.blake2b("\x00".join(parts).encode(), digest_size=8).hexdigest()


def chat_routing_key(messages: Sequence[dict]) -> str:
    """x-tandem-prefix of a chat: its system prompt and first user turn, which all its later turns share.

    "" (no key: the load balancer spreads requests) when the chat has no user turn yet.
    """
    system = next((m["content"] for m in messages if m["role"] == "system"), "")
    user = next((m["content"] for m in messages if m["role"] == "user"), None)
    return "" if user is None else prefix_key("chat", system, user)


def _gather(index: int, deltas: list[Delta]) -> Completion:
    """One completion from its deltas, in order."""
    logprobs = [lp for d in deltas for lp in d.logprobs or ()]
    reason = next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None)
    return Completion(index, "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], reason,
                      logprobs if any(d.logprobs for d in deltas) else None)


def _generate_request(request_id: str, prompt, messages, token_ids, model: str, timeout: float | None,
                      params: pb.SamplingParams) -> pb.GenerateRequest:
    given = [x is not None for x in (prompt, messages, token_ids)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, messages or token_ids")
    request = pb.GenerateRequest(request_id=request_id, params=params, model=model,
                                 timeout_ms=max(1, round(timeout * 1000)) if timeout is not None else 0)
    if prompt is not None:
        request.prompt = prompt
    elif messages is not None:
        request.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    else:
        request.token_ids.ids.extend(token_ids)
    return request
