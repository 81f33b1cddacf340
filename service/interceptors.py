"""Server interceptors: the replica name on every response, and an optional bearer-token check."""
from __future__ import annotations

import asyncio
import hmac
import inspect
from typing import Awaitable, Callable

import grpc

Before = Callable[[grpc.aio.ServicerContext], Awaitable[None]]


def _kind(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming:
        return "stream_stream" if handler.response_streaming else "stream_unary"
    return "unary_stream" if handler.response_streaming else "unary_unary"


def wrap_handler(handler: grpc.RpcMethodHandler | None, before: Before) -> grpc.RpcMethodHandler | None:
    """The same handler, awaiting before(context) first (it may abort the call)."""
    if handler is None:
        return None
    kind = _kind(handler)
    behaviour = getattr(handler, kind)
    if inspect.isasyncgenfunction(behaviour):
        async def wrapped(request, context):
            await before(context)
            async for item in behaviour(request, context):
                yield item
    else:
        async def wrapped(request, context):
            await before(context)
            return await behaviour(request, context)
    return handler._replace(**{kind: wrapped})


class ReplicaInterceptor(grpc.aio.ServerInterceptor):
    """Sends initial metadata `x-tandem-replica: <replica>` on every call, refusals included.

    `replica` may be set after construction (the server knows its port only once bound).
    """

    def __init__(self, replica: str = "") -> None:
        self.replica = replica

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        return wrap_handler(handler, self._send)

    async def _send(self, context: grpc.aio.ServicerContext) -> None:
        await context.send_initial_metadata((("x-tandem-replica", self.replica),))


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` (UNAUTHENTICATED); health checks stay open."""

    def __init__(self, token: str, exempt_prefixes: tuple[str, ...] = ("/grpc.health.v1.Health/",)) -> None:
        if not token:
            raise ValueError("the auth token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self._exempt = exempt_prefixes

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._exempt) \
                or self._authorized(handler_call_details):
            return handler
        return wrap_handler(handler, _deny_stream if handler.request_streaming else _deny)

    def _authorized(self, details) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected)
        return False


async def _deny_stream(context: grpc.aio.ServicerContext) -> None:
    # grpc.aio clients can report INTERNAL instead of our status when they write while the trailers arrive
    # (grpc/grpc#36066); taking the client's first message before answering closes that race for the usual
    # open-write-wait pattern.
    try:
        await asyncio.wait_for(context.read(), 1.0)
    except (asyncio.TimeoutError, grpc.RpcError):
        pass
    await _deny(context)


async def _deny(context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or invalid bearer token: send metadata 'authorization: Bearer <token>' "
                        "(the server's --auth-token / TANDEM_AUTH_TOKEN)")
