"""The tandem.v1.Tandem servicer: turns RPCs into bridge submissions and engine outputs into messages."""
from __future__ import annotations

import asyncio
import functools
import itertools
from typing import Any, AsyncIterator, Callable

import grpc

from engine.config import MAX_LOGPROBS, MAX_N
from proto import tandem_pb2 as pb
from service.bridge import EngineBridge
from service.catalog import Catalog
from service.errors import ServiceError, invalid
from service.handlers import Unparseable
from service.session import StreamSession
from service.submit import Limits, Submitter, generate_error

_FORWARDED_METADATA = ("traceparent", "tracestate", "x-tandem-prefix")


def _statuses(fn: Callable) -> Callable:
    """Answer a ServiceError raised by the handler with its status code and message."""
    @functools.wraps(fn)
    async def handler(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
    return handler


def _parsed(message: Any) -> Any:
    if isinstance(message, Unparseable):
        raise invalid(message.describe())
    return message


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """What a telemetry layer may want from the call: the door, the peer and trace context."""
    out = {"door": "grpc", "peer": context.peer() or ""}
    for key, value in context.invocation_metadata() or ():
        if key in _FORWARDED_METADATA and isinstance(value, str):
            out[key] = value
    return out


class TandemServicer:
    def __init__(self, bridge: EngineBridge, *, replica: str, limits: Limits) -> None:
        self.bridge = bridge
        self.replica = replica
        self.limits = limits
        self.catalog = Catalog()
        self.submitter = Submitter(bridge, self.catalog, limits)
        self._streams = itertools.count()

    async def load_model_info(self) -> None:
        self.catalog = await Catalog.load(self.bridge)
        self.submitter = Submitter(self.bridge, self.catalog, self.limits)

    # ---- Generate --------------------------------------------------------------------------------

    @_statuses
    async def Generate(self, request_iterator: AsyncIterator, context: grpc.aio.ServicerContext) -> None:
        # While draining, a new stream is still accepted: each request on it gets UNAVAILABLE (aborting the
        # stream at once races the client's first write, see grpc/grpc#36066).
        await self._serve_stream("generate", request_iterator, context, self._on_generate_message)

    def _on_generate_message(self, session: StreamSession, message: pb.GenerateClientMessage, meta: dict) -> None:
        kind = message.WhichOneof("kind")
        if kind == "request":
            self._start_generate(session, message.request, meta)
        elif kind == "cancel":
            self._cancel(session, message.cancel.request_id)
        else:
            session.send(generate_error("", invalid("empty client message: set request or cancel")))

    def _start_generate(self, session: StreamSession, req: pb.GenerateRequest, meta: dict) -> None:
        self.submitter.start_generate(session, req, meta)

    def _cancel(self, session: StreamSession, client_id: str) -> None:
        self.submitter.cancel(session, client_id)

    # ---- Rerank ----------------------------------------------------------------------------------

    @_statuses
    async def Rerank(self, request: Any, context: grpc.aio.ServicerContext) -> pb.RerankResponse:
        return await self.submitter.rerank(_parsed(request), _metadata(context))

    @_statuses
    async def RerankStream(self, request_iterator: AsyncIterator, context: grpc.aio.ServicerContext) -> None:
        await self._serve_stream("rerank", request_iterator, context, self._start_rerank)

    def _start_rerank(self, session: StreamSession, req: pb.RerankRequest, meta: dict) -> None:
        self.submitter.start_rerank(session, req, meta)

    # ---- streams (Generate, RerankStream) --------------------------------------------------------

    async def _serve_stream(self, kind: str, requests: AsyncIterator, context: grpc.aio.ServicerContext,
                            on_message: Callable[[StreamSession, Any, dict], None]) -> None:
        """One bidirectional stream: a reader task hands each client message to `on_message` (which submits
        to the engine and sends through the session) while this writes the session's messages; when the
        writing ends (input done and answered, the stream failed, the client left) the reader stops and the
        stream's live requests are aborted."""
        session = self.submitter.new_session()
        meta = {**_metadata(context), "stream": f"{kind}-{next(self._streams)}"}
        reader = asyncio.create_task(self._read_stream(requests, session, meta, on_message))
        try:
            async for message in session.messages():
                await context.write(message)
        finally:
            reader.cancel()
            for engine_id in session.engine_ids():
                self.bridge.abort(engine_id)

    @staticmethod
    async def _read_stream(requests: AsyncIterator, session: StreamSession, meta: dict,
                           on_message: Callable[[StreamSession, Any, dict], None]) -> None:
        try:
            async for message in requests:
                on_message(session, _parsed(message), meta)
            session.end_of_input()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an unparseable message, a broken transport: the stream fails
            session.fail(exc)

    # ---- ModelInfo -------------------------------------------------------------------------------

    @_statuses
    async def ModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        _parsed(request)
        info = self.catalog.info
        return pb.ModelInfoResponse(
            model=info.get("model", ""), served_names=self.catalog.names,
            architecture=info.get("architecture", ""), max_model_len=info.get("max_model_len", 0),
            block_size=info.get("block_size", 0), kv_blocks_total=info.get("kv_blocks_total", 0),
            reranker=info.get("reranker", ""), rerank_mode=info.get("rerank_mode", ""),
            device=info.get("device", ""), dtype=info.get("dtype", ""),
            replica=self.replica, weight_format=info.get("weight_format", ""),
            weight_bytes=info.get("weight_bytes", 0), vocab_size=info.get("vocab_size", 0),
            rerank_max_pair_tokens=info.get("rerank_max_pair_tokens", 0),
            rerank_limit_by=info.get("rerank_limit_by", ""), cpu_kernels=info.get("cpu_kernels", ""),
            limits=pb.Limits(max_waiting=self.bridge.max_waiting, max_documents=self.limits.max_documents,
                             max_message_bytes=self.limits.max_message_bytes, max_n=MAX_N,
                             max_logprobs=MAX_LOGPROBS))
