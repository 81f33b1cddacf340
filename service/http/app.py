"""The HTTP door (Starlette): each request is parsed with pydantic into the core API's inputs (service/core.py, the
API the gRPC door calls too); its outputs come back in each API's shape. No protobuf here.

| Route                        | Shape   | Scope (gRPC method) |
|------------------------------|---------|---------------------|
| POST /v1/chat/completions    | OpenAI  | Generate            |
| POST /v1/completions         | OpenAI  | Generate            |
| GET  /v1/models[/{model}]    | OpenAI  | ModelInfo           |
| POST /v1/rerank, /v2/rerank  | Cohere  | Rerank              |
| POST /rerank                 | TEI     | Rerank              |
| POST /v1/embeddings          | OpenAI  | Embed               |
| POST /embed, /embed_all      | TEI     | Embed               |
| POST /v2/embed               | Cohere  | Embed               |
| POST /predict                | TEI     | Classify            |
| POST /classify               | vLLM    | Classify            |
| POST /embed_sparse           | TEI     | EmbedSparse         |
| POST /tokenize, /detokenize  | vLLM    | ModelInfo           |
| GET  /info                   | TEI     | ModelInfo           |
| GET  /version, /openapi.json, /docs | plain | open         |
| GET  /health, /healthz, /ready, /metrics | plain | open (as gRPC health) |
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.metadata
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from service.auth import TokenTable
from service.core import CoreAPI, GenerateEvent, GenerateInput, GenerationStream, RerankInput, RerankOutcome
from service.core import EmbedInput, EmbedOutcome, ServedModel
from service import kinds
from service.errors import ServiceError
from service.http import embed_schema, openai_schema, openapi, rerank_schema, tokens_schema
from service.http.errors import HttpError, Shape
from service.http.hosts import host_allowed
from service.http.kind_routes import KindRoute, kind_routes
from service.http.openai_output import Completion

log = logging.getLogger("tandem.http")
try:
    VERSION = importlib.metadata.version("tandem")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    VERSION = "0+unknown"
_FORWARDED_HEADERS = ("traceparent", "tracestate", "x-tandem-prefix")
_METHOD = "/tandem.v1.Tandem/"


class BodyTooLarge(Exception):
    pass


class _Gone(Exception):
    """The client went away before its answer was ready."""


@dataclass(slots=True)
class Door:
    """What the routes need: the core API, limits, auth, health, metrics."""
    core: CoreAPI
    max_body_bytes: int
    tokens_table: TokenTable | None
    serving: Callable[[], bool]
    registry: CollectorRegistry | None
    replica: str
    started: int = 0
    allowed_hosts: tuple[str, ...] | None = None  # Host header patterns answered (service/http/hosts.py); None: any

    def meta(self, request: Request) -> dict[str, str]:
        client = request.client
        meta = {"door": "http", "route": request.url.path, "peer": f"{client.host}:{client.port}" if client else ""}
        for key in _FORWARDED_HEADERS:
            value = request.headers.get(key)
            if value is not None:
                meta[key] = value
        return meta

    def authorize(self, request: Request, method: str) -> None:
        if self.tokens_table is None:
            return
        known, allowed = self.tokens_table.check(request.headers.get("authorization"), _METHOD + method)
        if not known:
            raise HttpError(401, "missing or invalid bearer token: send the header 'Authorization: Bearer <token>' "
                                 "(the server's --auth-token / TANDEM_AUTH_TOKEN)", code="invalid_api_key")
        if not allowed:
            raise HttpError(403, f"this bearer token may not call {_METHOD}{method} (this route); ask for a token "
                                 "whose scope includes it (--auth-token, --auth-scoped-tokens)")


def build_app(door: Door) -> Starlette:
    door.started = int(time.time())

    def route(path: str, handler, shape: Shape, methods: list[str]) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                if request.method == "POST":
                    _check_json(request)
                return await handler(door, request)
            except HttpError as exc:
                if not exc.from_core:  # refused by this door itself: the access log hears of it here
                    door.core.refused_at_door(_kind(path), door.meta(request), str(exc.status))
                return _error(exc, shape)
            except ServiceError as exc:
                return _error(HttpError.from_service(exc), shape)
            except BodyTooLarge:
                door.core.refused_at_door(_kind(path), door.meta(request), "413")
                return _error(HttpError(413, f"request body over {door.max_body_bytes} bytes (--max-message-bytes)",
                                        code="request_too_large"), shape)
            except (ClientDisconnect, _Gone):
                return Response(status_code=499)
            except Exception as exc:  # a bug: the client gets its type, the log its trace
                log.exception("HTTP %s failed", path)
                return _error(HttpError(500, f"internal error ({type(exc).__name__}); see the server log"), shape)
        return Route(path, endpoint, methods=methods)

    document = openapi.openapi_document(VERSION)
    routes = [route("/v1/chat/completions", _chat, Shape.OPENAI, ["POST"]),
              route("/v1/completions", _completions, Shape.OPENAI, ["POST"]),
              route("/v1/models", _models, Shape.OPENAI, ["GET"]),
              route("/v1/models/{model:path}", _model, Shape.OPENAI, ["GET"]),
              route("/v1/rerank", _cohere_v1, Shape.COHERE, ["POST"]),
              route("/v2/rerank", _cohere_v2, Shape.COHERE, ["POST"]),
              route("/rerank", _tei, Shape.TEI, ["POST"]),
              route("/tokenize", _tokenize, Shape.OPENAI, ["POST"]),
              route("/detokenize", _detokenize, Shape.OPENAI, ["POST"]),
              route("/info", _tei_info, Shape.TEI, ["GET"]),
              Route("/version", _version, methods=["GET"]),
              Route("/openapi.json", lambda request: JSONResponse(document), methods=["GET"]),
              Route("/docs", lambda request: HTMLResponse(openapi.docs_page(document)), methods=["GET"]),
              Route("/health", _health, methods=["GET"]),
              Route("/healthz", functools.partial(_ready, door), methods=["GET"]),
              Route("/ready", functools.partial(_ready, door), methods=["GET"]),
              Route("/metrics", functools.partial(_metrics, door), methods=["GET"])]
    routes += [route(path, handler, shape, ["POST"]) for path, handler, shape in (*EMBED_ROUTES, *POOLED_ROUTES)]

    async def http_error(request: Request, exc: HTTPException) -> Response:
        what = "no such route" if exc.status_code == 404 else exc.detail
        return _error(HttpError(exc.status_code, f"{what}: {request.method} {request.url.path} (see docs/http.md)"),
                      Shape.OPENAI)

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    return _BodyLimit(app, door.max_body_bytes, door.replica, door.allowed_hosts)


def _kind(path: str) -> str:
    """What a route's requests are, for the lifecycle hooks: its kind's label (service/kinds.py), or the route
    itself."""
    kind = kinds.by_route(path)
    return kind.label if kind is not None else path


def _check_json(request: Request) -> None:
    """415 for a body declared as something other than JSON: a web page's form post
    (application/x-www-form-urlencoded, multipart/form-data, text/plain: the "simple requests" a browser sends
    cross-site without asking first) never reaches a route. No Content-Type is read as JSON (a body that does not
    parse is then a 400 saying where)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        hint = " (curl -d sends that unless told otherwise: add -H 'Content-Type: application/json')" \
            if media == "application/x-www-form-urlencoded" else ""
        raise HttpError(415, f"the body must be JSON (Content-Type: application/json), got {declared!r}{hint}",
                        code="unsupported_media_type")


def _error(exc: HttpError, shape: Shape) -> Response:
    return JSONResponse(exc.body(shape), status_code=exc.status)


# ---- generation ----------------------------------------------------------------------------------

async def _chat(door: Door, request: Request) -> Response:
    door.authorize(request, "Generate")
    body = openai_schema.parse(openai_schema.ChatRequest, await request.body())
    try:
        tools = door.core.tool_plan(body.tool_definitions(), body.tool_choice, body.parallel_tool_calls)
    except ServiceError as exc:
        raise HttpError(400, exc.message, param="tool_choice") from None
    inputs = body.to_inputs(tools)
    top = (body.top_logprobs or 0) if body.logprobs else None
    return await _generate(door, request, body, inputs, Completion(
        chat=True, model=door.core.model_name(body.model), n=body.n or 1, tokens=door.core.token_texts,
        top_logprobs=top, include_usage=bool(body.stream_options and body.stream_options.include_usage),
        tools=tools))


async def _completions(door: Door, request: Request) -> Response:
    door.authorize(request, "Generate")
    body = openai_schema.parse(openai_schema.CompletionRequest, await request.body())
    inputs = body.to_inputs()
    return await _generate(door, request, body, inputs, Completion(
        chat=False, model=door.core.model_name(body.model), n=body.n or 1, tokens=door.core.token_texts,
        top_logprobs=body.logprobs, include_usage=bool(body.stream_options and body.stream_options.include_usage)))


async def _generate(door: Door, request: Request, body, inputs: list[GenerateInput], out: Completion) -> Response:
    timeout_ms = _timeout_ms(request)
    meta = door.meta(request)
    if body.user:
        meta["user"] = body.user
    stream = door.core.generate([dataclasses.replace(inp, timeout_ms=timeout_ms) for inp in inputs], meta)
    out.id = stream.ids[0]  # the request's one id (of its first prompt, with several): chatcmpl-<id>
    watcher = asyncio.ensure_future(_disconnected(request))
    streaming = False  # once the StreamingResponse owns the stream, its generator aborts what is left
    gone = False
    try:
        first = await _until_gone(anext(stream), watcher)
        if first.error is not None:  # refused by the engine (e.g. prompt too long): a plain status
            raise HttpError.from_service(first.error)
        if body.stream:
            watcher.cancel()  # the StreamingResponse watches for the disconnect from here on
            streaming = True
            return _EventStream(_sse(first, stream, out), stream)
        out.add(first)
        while True:
            try:
                event = await _until_gone(anext(stream), watcher)
            except StopAsyncIteration:
                break
            if event.error is not None:
                raise HttpError.from_service(event.error)
            out.add(event)
        return JSONResponse(out.response())
    except _Gone:
        gone = True
        raise
    finally:
        watcher.cancel()
        if not streaming:  # answered, refused or left: nothing of this request may run on
            stream.abort(client_gone=gone)


async def _sse(first: GenerateEvent, stream: GenerationStream, out: Completion) -> AsyncIterator[bytes]:
    yield out.chunk(first)
    async for event in stream:
        if event.error is not None:
            yield HttpError.from_service(event.error).sse()
            continue
        if data := out.chunk(event):
            yield data
    yield out.closing()


class _EventStream(StreamingResponse):
    """Server-sent events; the stream is aborted however the response ends (done, failed, or the client went away,
    which cancels the sending), so nothing of the request runs on after it. Ended without an error before every
    event was read: the client went away."""

    def __init__(self, content: AsyncIterator[bytes], stream: GenerationStream) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope, receive, send) -> None:
        gone = False
        try:
            await super().__call__(scope, receive, send)
            gone = not self._stream.done
        except (ClientDisconnect, OSError):
            gone = True
            raise
        finally:
            self._stream.abort(client_gone=gone)


def _timeout_ms(request: Request) -> int:
    value = request.headers.get("x-tandem-timeout-ms")
    if value is None:
        return 0
    if not value.isdigit() or int(value) >= 2**32:
        raise HttpError(400, f"x-tandem-timeout-ms must be a whole number of milliseconds, got {value!r}",
                        param="x-tandem-timeout-ms")
    return int(value)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read already, so receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until_gone(awaitable: Awaitable, watcher: asyncio.Future) -> Any:
    """awaitable's result, or _Gone if the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()
    raise _Gone()


# ---- rerank --------------------------------------------------------------------------------------

async def _unary(door: Door, request: Request, call, inp):
    """`call(inp, metadata)` of the core API (rerank, embed) with the request's timeout; a client that disconnects
    first cancels it (the core then aborts the engine job)."""
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        return await _until_gone(call(dataclasses.replace(inp, timeout_ms=_timeout_ms(request)), door.meta(request)),
                                 watcher)
    finally:
        watcher.cancel()


async def _rerank(door: Door, request: Request, inp: RerankInput) -> RerankOutcome:
    return await _unary(door, request, door.core.rerank, inp)


async def _cohere(door: Door, request: Request, default_return_documents: bool) -> Response:
    door.authorize(request, "Rerank")
    body = openai_schema.parse(rerank_schema.CohereRerank, await request.body())
    outcome = await _rerank(door, request, body.to_input(default_return_documents))
    return JSONResponse(rerank_schema.cohere_response(outcome, model=outcome.model),
                        headers=rerank_schema.mode_header(outcome))


async def _cohere_v1(door: Door, request: Request) -> Response:
    return await _cohere(door, request, default_return_documents=True)  # Cohere v1 and Jina return them


async def _cohere_v2(door: Door, request: Request) -> Response:
    return await _cohere(door, request, default_return_documents=False)


async def _tei(door: Door, request: Request) -> Response:
    door.authorize(request, "Rerank")
    body = openai_schema.parse(rerank_schema.TeiRerank, await request.body())
    outcome = await _rerank(door, request, body.to_input())
    return JSONResponse(rerank_schema.tei_response(outcome), headers=rerank_schema.mode_header(outcome))


# ---- tokens, version, info -----------------------------------------------------------------------

async def _tokenize(door: Door, request: Request) -> Response:
    door.authorize(request, "ModelInfo")
    body = openai_schema.parse(tokens_schema.TokenizeRequest, await request.body()).checked()
    ids = await door.core.tokenize(prompt=body.prompt, messages=body.chat(),
                                   add_special_tokens=body.add_special_tokens, model=body.model)
    return JSONResponse({"count": len(ids), "max_model_len": door.core.info.max_model_len, "tokens": ids,
                         "token_strs": None})


async def _detokenize(door: Door, request: Request) -> Response:
    door.authorize(request, "ModelInfo")
    body = openai_schema.parse(tokens_schema.DetokenizeRequest, await request.body())
    openai_schema.refuse_extras(body)
    return JSONResponse({"prompt": await door.core.detokenize(body.tokens, model=body.model)})


async def _tei_info(door: Door, request: Request) -> Response:
    door.authorize(request, "ModelInfo")
    return JSONResponse(tokens_schema.tei_info(door.core.info, VERSION, door.core.rerank_name))


async def _version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


# ---- models, health, metrics ---------------------------------------------------------------------

def _model_card(door: Door, model: ServedModel, name: str | None = None) -> dict:
    """OpenAI's model object plus what the model does: `task` (vLLM's word for its main one: generate, embed, rerank)
    and every one of them in `capabilities` (Infinity's field), and its input limit."""
    return {"id": name or model.name, "object": "model", "created": door.started, "owned_by": "tandem",
            "task": model.tasks[0].value, "capabilities": [t.value for t in model.tasks],
            "max_model_len": model.max_tokens}


async def _models(door: Door, request: Request) -> Response:
    door.authorize(request, "ModelInfo")
    return JSONResponse({"object": "list", "data": [_model_card(door, m) for m in door.core.models()]})


async def _model(door: Door, request: Request) -> Response:
    door.authorize(request, "ModelInfo")
    name = request.path_params["model"]
    if not name:
        raise HttpError(404, "no model name given", code="model_not_found")
    models = {m.name: m for m in door.core.models()}
    if name not in models:
        door.core.check_model(name)  # 404 unless an alias of the served model (the path as given)
    return JSONResponse(_model_card(door, models.get(name, models[door.core.info.model]), name))


async def _health(request: Request) -> Response:
    return PlainTextResponse("OK\n", headers={"Cache-Control": "no-store"})


async def _ready(door: Door, request: Request) -> Response:
    ok = door.serving()
    return PlainTextResponse("SERVING\n" if ok else "NOT_SERVING\n", status_code=200 if ok else 503,
                             headers={"Cache-Control": "no-store"})


async def _metrics(door: Door, request: Request) -> Response:
    data = generate_latest(door.registry) if door.registry is not None else b""
    return Response(data, media_type=CONTENT_TYPE_LATEST)


# ---- body size -----------------------------------------------------------------------------------

class _BodyLimit:
    """ASGI middleware, before routing and auth: a Host header not allowed (service/http/hosts.py) is answered 400;
    a body over `limit` bytes fails the request's body read (BodyTooLarge -> 413); a Content-Length over it is
    answered at once without reading. Adds x-tandem-replica to every response."""

    def __init__(self, app, limit: int, replica: str, hosts: tuple[str, ...] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.replica = replica.encode()
        self.hosts = hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-tandem-replica", self.replica)]
            await send(message)

        headers = dict(scope.get("headers") or ())
        shape = Shape.TEI if scope["path"] == "/rerank" else \
            Shape.COHERE if scope["path"].endswith("/rerank") else Shape.OPENAI
        host = headers.get(b"host")
        if not host_allowed(None if host is None else host.decode("latin-1"), self.hosts):
            log.warning("HTTP request refused: Host %r is not allowed (--allowed-hosts)", host.decode("latin-1"))
            body = HttpError(400, f"Host {host.decode('latin-1')!r} is not allowed: this server answers "
                                  f"{', '.join(self.hosts)} (tandem serve --allowed-hosts adds names)",
                             code="invalid_host")
            return await _error(body, shape)(scope, receive, send_named)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            body = HttpError(413, f"request body of {int(length)} bytes is over the limit of {self.limit} bytes "
                                  "(--max-message-bytes)", code="request_too_large")
            return await _error(body, shape)(scope, receive, send_named)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge()
            return message

        await self.app(scope, counted, send_named)


# ---- embeddings ----------------------------------------------------------------------------------

async def _embed(door: Door, request: Request, inp: EmbedInput) -> EmbedOutcome:
    return await _unary(door, request, door.core.embed, inp)


async def _openai_embeddings(door: Door, request: Request) -> Response:
    door.authorize(request, "Embed")
    body = openai_schema.parse(embed_schema.OpenAIEmbed, await request.body())
    outcome = await _embed(door, request, body.to_input())
    return JSONResponse(embed_schema.openai_response(outcome, body.encoding_format, outcome.model))


async def _tei_embed(door: Door, request: Request) -> Response:
    door.authorize(request, "Embed")
    body = openai_schema.parse(embed_schema.TeiEmbed, await request.body())
    return JSONResponse((await _embed(door, request, body.to_input())).embeddings)


async def _cohere_embed(door: Door, request: Request) -> Response:
    door.authorize(request, "Embed")
    body = openai_schema.parse(embed_schema.CohereEmbed, await request.body())
    return JSONResponse(embed_schema.cohere_response(await _embed(door, request, body.to_input()), body))


async def _tei_embed_all(door: Door, request: Request) -> Response:
    door.authorize(request, "Embed")
    body = openai_schema.parse(embed_schema.TeiEmbedAll, await request.body())
    return JSONResponse((await _embed(door, request, body.to_input())).embeddings)


# ---- the kinds served by an encoder of their own (classification, sparse embeddings) ---------------------------

def _pooled_route(kind: kinds.Kind, route: KindRoute) -> Callable[[Door, Request], Awaitable[Response]]:
    """The handler of one route of a kind served by an encoder of its own: its body (the kind's door schema), the
    core's pool call for the kind, the outcome in the route's shape."""
    async def handler(door: Door, request: Request) -> Response:
        door.authorize(request, kind.grpc_method)
        body = openai_schema.parse(route.body, await request.body())
        outcome = await _unary(door, request, functools.partial(door.core.pool, kind.task), body.to_input())
        return JSONResponse(route.respond(outcome, body))
    return handler


EMBED_ROUTES = (("/v1/embeddings", _openai_embeddings, Shape.OPENAI), ("/embed", _tei_embed, Shape.TEI),
                ("/embed_all", _tei_embed_all, Shape.TEI), ("/v2/embed", _cohere_embed, Shape.COHERE))
# Each pooled kind's routes, as service/kinds.py names them and its door schema module answers them.
POOLED_ROUTES = tuple((path, _pooled_route(kind, route), route.shape)
                      for kind in kinds.pooled() for path, route in kind_routes(kind).items())
