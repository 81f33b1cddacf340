"""The tandem.v1.Tandem servicer: turns RPCs into bridge submissions and engine outputs into messages."""
from __future__ import annotations

import asyncio
import functools
import itertools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import grpc

from engine.config import MAX_LOGPROBS, MAX_N
from proto import tandem_pb2 as pb
from service import convert
from service.bridge import EngineBridge
from service.errors import ServiceError, invalid
from service.handlers import Unparseable
from service.lifecycle import RequestLifecycle
from service.session import DEFAULT_MAX_BUFFER_BYTES, StreamSession

if TYPE_CHECKING:
    from engine import RerankParams

_FORWARDED_METADATA = ("traceparent", "tracestate", "x-tandem-prefix")


@dataclass(slots=True)
class Limits:
    max_documents: int = 1000
    max_message_bytes: int = 4 * 2**20
    max_stream_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES  # responses a stream may queue unread (service/session.py)


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
    """What a telemetry layer may want from the call: the peer and trace context."""
    out = {"peer": context.peer() or ""}
    for key, value in context.invocation_metadata() or ():
        if key in _FORWARDED_METADATA and isinstance(value, str):
            out[key] = value
    return out


class TandemServicer:
    def __init__(self, bridge: EngineBridge, *, replica: str, limits: Limits) -> None:
        self.bridge = bridge
        self.replica = replica
        self.limits = limits
        self.info: dict = {}
        self.served_names: set[str] = {""}
        self._streams = itertools.count()

    async def load_model_info(self) -> None:
        self.info = await self.bridge.call(_model_info)
        self.served_names = {"", self.info["model"], os.path.basename(str(self.info.get("model_dir", "")))} - {None}

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
            session.send(_generate_error("", invalid("empty client message: set request or cancel")))

    def _start_generate(self, session: StreamSession, req: pb.GenerateRequest, meta: dict) -> None:
        client_id = req.request_id
        try:
            self._check_new_id(session, client_id)
            self._check_model(req.model)
            prompt = convert.generate_input(req)
            params = convert.sampling_params(req.params)
            lc: RequestLifecycle | None = None

            def sink(event: Any) -> None:
                if isinstance(event, ServiceError):
                    session.send(_generate_error(client_id, event))
                    session.finished(client_id)
                    return
                session.send(convert.generate_message(client_id, event, lc))
                if event.finished:
                    session.finished(client_id)

            lc = self.bridge.submit_generate(client_id, sink, params=params, timeout_ms=req.timeout_ms,
                                             metadata=meta, **prompt)
            session.live[client_id] = lc
        except ServiceError as exc:
            session.send(_generate_error(client_id, exc))

    def _cancel(self, session: StreamSession, client_id: str) -> None:
        lc = session.live.get(client_id)
        if lc is None:
            session.send(_generate_error(client_id, ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"cancel: no live request {client_id!r} on this stream (it finished already or never started)")))
            return
        self.bridge.abort(lc.engine_id)

    # ---- Rerank ----------------------------------------------------------------------------------

    @_statuses
    async def Rerank(self, request: Any, context: grpc.aio.ServicerContext) -> pb.RerankResponse:
        req: pb.RerankRequest = _parsed(request)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        params, documents = self._rerank_args(req)
        lc = self.bridge.submit_rerank(req.request_id, lambda event: future.done() or future.set_result(event),
                                       query=req.query, documents=documents, params=params,
                                       metadata=_metadata(context))
        try:
            event = await future
        finally:
            if not future.done():  # cancelled: the client left or its deadline passed
                self.bridge.abort(lc.engine_id)
        return self._rerank_result(req.request_id, event, documents, params, lc)

    @_statuses
    async def RerankStream(self, request_iterator: AsyncIterator, context: grpc.aio.ServicerContext) -> None:
        await self._serve_stream("rerank", request_iterator, context, self._start_rerank)

    def _start_rerank(self, session: StreamSession, req: pb.RerankRequest, meta: dict) -> None:
        client_id = req.request_id
        try:
            self._check_new_id(session, client_id)
            params, documents = self._rerank_args(req)
            lc: RequestLifecycle | None = None

            def sink(event: Any) -> None:
                try:
                    response = self._rerank_result(client_id, event, documents, params, lc)
                    session.send(pb.RerankStreamResponse(request_id=client_id, response=response))
                except ServiceError as exc:
                    session.send(pb.RerankStreamResponse(request_id=client_id, error=convert.request_error(exc)))
                session.finished(client_id)

            lc = self.bridge.submit_rerank(client_id, sink, query=req.query, documents=documents, params=params,
                                           metadata=meta)
            session.live[client_id] = lc
        except ServiceError as exc:
            session.send(pb.RerankStreamResponse(request_id=client_id, error=convert.request_error(exc)))

    def _rerank_args(self, req: pb.RerankRequest) -> tuple["RerankParams", list[str]]:
        """Checks that need no engine (model, document count), then the engine's RerankParams."""
        self._check_model(req.model)
        if len(req.documents) > self.limits.max_documents:
            raise invalid(f"documents has {len(req.documents)} items; this server takes at most "
                          f"{self.limits.max_documents} per request (--max-documents); split the request")
        return convert.rerank_params(req), list(req.documents)

    @staticmethod
    def _rerank_result(client_id: str, event: Any, documents: list[str], params, lc) -> pb.RerankResponse:
        if isinstance(event, ServiceError):
            raise event
        if event.finish_reason == "abort":  # aborted by the server (drain timeout)
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "rerank aborted: the server is shutting down; retry")
        return convert.rerank_response(client_id, event, documents, params, lc)

    # ---- streams (Generate, RerankStream) --------------------------------------------------------

    async def _serve_stream(self, kind: str, requests: AsyncIterator, context: grpc.aio.ServicerContext,
                            on_message: Callable[[StreamSession, Any, dict], None]) -> None:
        """One bidirectional stream: a reader task hands each client message to `on_message` (which submits
        to the engine and sends through the session) while this writes the session's messages; when the
        writing ends (input done and answered, the stream failed, the client left) the reader stops and the
        stream's live requests are aborted."""
        session = StreamSession(self.limits.max_stream_buffer_bytes, abort=self.bridge.abort)
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
        info = self.info
        return pb.ModelInfoResponse(
            model=info.get("model", ""), served_names=sorted(n for n in self.served_names if n),
            architecture=info.get("architecture", ""), max_model_len=info.get("max_model_len", 0),
            block_size=info.get("block_size", 0), kv_blocks_total=info.get("kv_blocks_total", 0),
            reranker=info.get("reranker", ""), rerank_mode=info.get("rerank_mode", ""),
            device=info.get("device", ""), dtype=info.get("dtype", ""),
            replica=self.replica, weight_format=info.get("weight_format", ""),
            weight_bytes=info.get("weight_bytes", 0), vocab_size=info.get("vocab_size", 0),
            rerank_max_pair_tokens=info.get("rerank_max_pair_tokens", 0),
            rerank_limit_by=info.get("rerank_limit_by", ""),
            limits=pb.Limits(max_waiting=self.bridge.max_waiting, max_documents=self.limits.max_documents,
                             max_message_bytes=self.limits.max_message_bytes, max_n=MAX_N,
                             max_logprobs=MAX_LOGPROBS))

    # ---- checks ----------------------------------------------------------------------------------

    @staticmethod
    def _check_new_id(session: StreamSession, client_id: str) -> None:
        if not client_id:
            raise invalid("request_id must be a non-empty string")
        if client_id in session.live:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {client_id!r} is already live on this stream; ids must be unique "
                               "among a stream's unfinished requests (the earlier request goes on)")

    def _check_model(self, model: str) -> None:
        if model not in self.served_names:
            served = sorted(n for n in self.served_names if n)
            raise ServiceError(grpc.StatusCode.NOT_FOUND,
                               f"model {model!r} is not served by this replica; it serves {served} "
                               "(leave model empty for the default)")


def _model_info(engine) -> dict:
    """engine.model_info() plus the vocabulary size clients need for token ids and logit_bias."""
    return {**engine.model_info(), "vocab_size": engine.model_args.vocab_size}


def _generate_error(client_id: str, error: ServiceError) -> pb.GenerateServerMessage:
    return pb.GenerateServerMessage(request_id=client_id, error=convert.request_error(error))
