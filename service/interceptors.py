"""Server interceptors: the replica name on every response, and an optional bearer-token check."""
from __future__ import annotations

import asyncio
import inspect
from typing import Awaitable, Callable, Mapping

import grpc

from service.auth import TokenTable

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
    """Checks `authorization: Bearer <token>`; health checks stay open.

    `token` may call every method; each of `scoped` may call only the methods it lists (names of
    tandem.v1.Tandem methods such as "Rerank", or full paths "/package.Service/Method"). No or an unknown
    token: UNAUTHENTICATED. A known token outside its scope: PERMISSION_DENIED.
    """

    def __init__(self, token: str | None, scoped: Mapping[str, tuple[str, ...] | list[str]] | None = None,
                 exempt_prefixes: tuple[str, ...] = ("/grpc.health.v1.Health/",)) -> None:
        self._table = TokenTable(token, scoped)
        self._exempt = exempt_prefixes

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self._exempt):
            return handler
        known, allowed = self._check(handler_call_details)
        if allowed:
            return handler
        if not known:
            deny = _deny
        else:
            async def deny(context: grpc.aio.ServicerContext) -> None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"this bearer token may not call {method}; ask for a token whose scope "
                                    "includes it (--auth-token, --auth-scoped-tokens)")
        return wrap_handler(handler, _read_first(deny) if handler.request_streaming else deny)

    def _check(self, details) -> tuple[bool, bool]:
        """(the token is known, it may call this method)."""
        given = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value
                break
        return self._table.check(given, details.method)


def _read_first(deny: Before) -> Before:
    # grpc.aio clients can report INTERNAL instead of our status when they write while the trailers arrive
    # (grpc/grpc#36066); taking the client's first message before answering closes that race for the usual
    # open-write-wait pattern.
    async def deny_stream(context: grpc.aio.ServicerContext) -> None:
        try:
            await asyncio.wait_for(context.read(), 1.0)
        except (asyncio.TimeoutError, grpc.RpcError):
            pass
        await deny(context)
    return deny_stream


async def _deny(context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or invalid bearer token: send metadata 'authorization: Bearer <token>' "
                        "(the server's --auth-token / TANDEM_AUTH_TOKEN)")
