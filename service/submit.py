"""Request messages to engine work, for both doors: the gRPC servicer and the HTTP app call the same code.

A generation starts on a `StreamSession` (its responses are queued there, bounded, as GenerateServerMessages);
a rerank is awaited (unary) or started on a session (RerankStream). Every check that needs no engine (model
name, request ids, document count) and every conversion to engine parameters happens here, so a request is
refused the same way whichever door it came through.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from proto import tandem_pb2 as pb
from service import convert
from service.bridge import EngineBridge
from service.catalog import Catalog
from service.errors import ServiceError, invalid
from service.lifecycle import RequestLifecycle
from service.session import DEFAULT_MAX_BUFFER_BYTES, StreamSession

if TYPE_CHECKING:
    from engine import RerankParams


@dataclass(slots=True)
class Limits:
    max_documents: int = 1000
    max_message_bytes: int = 4 * 2**20
    max_stream_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES  # responses a stream may queue unread (service/session.py)


class Submitter:
    def __init__(self, bridge: EngineBridge, catalog: Catalog, limits: Limits) -> None:
        self.bridge = bridge
        self.catalog = catalog
        self.limits = limits

    def new_session(self) -> StreamSession:
        return StreamSession(self.limits.max_stream_buffer_bytes, abort=self.bridge.abort)

    # ---- generation ------------------------------------------------------------------------------

    def start_generate(self, session: StreamSession, req: pb.GenerateRequest, meta: dict) -> None:
        """Admit req on session; its deltas, final message or error are sent through the session."""
        try:
            self.admit_generate(session, req, meta)
        except ServiceError as exc:
            session.send(generate_error(req.request_id, exc))

    def admit_generate(self, session: StreamSession, req: pb.GenerateRequest, meta: dict) -> RequestLifecycle:
        """Admit req on session or raise ServiceError; once admitted, its messages go through the session."""
        client_id = req.request_id
        self.check_new_id(session, client_id)
        self.catalog.check_model(req.model)
        prompt = convert.generate_input(req)
        params = convert.sampling_params(req.params)
        lc: RequestLifecycle | None = None

        def sink(event: Any) -> None:
            if isinstance(event, ServiceError):
                session.send(generate_error(client_id, event))
                session.finished(client_id)
                return
            session.send(convert.generate_message(client_id, event, lc))
            if event.finished:
                session.finished(client_id)

        lc = self.bridge.submit_generate(client_id, sink, params=params, timeout_ms=req.timeout_ms,
                                         metadata=meta, **prompt)
        session.live[client_id] = lc
        return lc

    def cancel(self, session: StreamSession, client_id: str) -> None:
        lc = session.live.get(client_id)
        if lc is None:
            session.send(generate_error(client_id, ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"cancel: no live request {client_id!r} on this stream (it finished already or never started)")))
            return
        self.bridge.abort(lc.engine_id)

    # ---- rerank ----------------------------------------------------------------------------------

    async def rerank(self, req: pb.RerankRequest, meta: dict) -> pb.RerankResponse:
        """Score req's documents; raises ServiceError. Cancelling the await aborts the engine job."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        params, documents = self.rerank_args(req)
        lc = self.bridge.submit_rerank(req.request_id, lambda event: future.done() or future.set_result(event),
                                       query=req.query, documents=documents, params=params, metadata=meta)
        try:
            event = await future
        finally:
            if not future.done():  # cancelled: the client left or its deadline passed
                self.bridge.abort(lc.engine_id)
        return self.rerank_result(req.request_id, event, documents, params, lc)

    def start_rerank(self, session: StreamSession, req: pb.RerankRequest, meta: dict) -> None:
        client_id = req.request_id
        try:
            self.check_new_id(session, client_id)
            params, documents = self.rerank_args(req)
            lc: RequestLifecycle | None = None

            def sink(event: Any) -> None:
                try:
                    response = self.rerank_result(client_id, event, documents, params, lc)
                    session.send(pb.RerankStreamResponse(request_id=client_id, response=response))
                except ServiceError as exc:
                    session.send(pb.RerankStreamResponse(request_id=client_id, error=convert.request_error(exc)))
                session.finished(client_id)

            lc = self.bridge.submit_rerank(client_id, sink, query=req.query, documents=documents, params=params,
                                           metadata=meta)
            session.live[client_id] = lc
        except ServiceError as exc:
            session.send(pb.RerankStreamResponse(request_id=client_id, error=convert.request_error(exc)))

    def rerank_args(self, req: pb.RerankRequest) -> tuple["RerankParams", list[str]]:
        """Checks that need no engine (model, document count), then the engine's RerankParams."""
        self.catalog.check_model(req.model)
        if len(req.documents) > self.limits.max_documents:
            raise invalid(f"documents has {len(req.documents)} items; this server takes at most "
                          f"{self.limits.max_documents} per request (--max-documents); split the request")
        return convert.rerank_params(req), list(req.documents)

    @staticmethod
    def rerank_result(client_id: str, event: Any, documents: list[str], params, lc) -> pb.RerankResponse:
        if isinstance(event, ServiceError):
            raise event
        if event.finish_reason == "abort":  # aborted by the server (drain timeout)
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "rerank aborted: the server is shutting down; retry")
        return convert.rerank_response(client_id, event, documents, params, lc)

    # ---- checks ----------------------------------------------------------------------------------

    @staticmethod
    def check_new_id(session: StreamSession, client_id: str) -> None:
        if not client_id:
            raise invalid("request_id must be a non-empty string")
        if client_id in session.live:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {client_id!r} is already live on this stream; ids must be unique "
                               "among a stream's unfinished requests (the earlier request goes on)")


def generate_error(client_id: str, error: ServiceError) -> pb.GenerateServerMessage:
    return pb.GenerateServerMessage(request_id=client_id, error=convert.request_error(error))
