"""The gRPC door: tandem.v1.Tandem RPCs to core API calls, protobuf converted here and nowhere else.

Generate and RerankStream multiplex many requests on one stream (a `StreamSession`: client id -> live request,
and a bounded outbox of messages); each admitted request is pumped from the core API into the session by a task
of its own. The session's outbox is the stream's one bounded channel (--max-stream-buffer-bytes, one overflow path):
a pump moves each event into it as the engine hands it over, so a generation's core stream is a relay that counts
nothing (CoreAPI.generate(relayed=True)). Rerank, Embed and ModelInfo are unary.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
from typing import Any, AsyncIterator, Callable

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from engine.config import EmbedParams, RerankParams, SamplingParams, StructuredOutputsParams
from engine.outputs import Logprobs, TokenDelta
from engine.request import FinishReason
from proto import tandem_pb2 as pb
from service.core import CoreAPI, GenerateEvent, GenerateInput, RerankInput, RerankOutcome, Usage, json_schema
from service.core import EmbedInput, EmbedOutcome, PooledOutcome
from service.errors import ErrorKind, ServiceError, invalid
from service.kinds import Kind, Task
from service.handlers import Unparseable, rpc_types
from service.session import StreamSession

_FORWARDED_METADATA = ("traceparent", "tracestate", "x-tandem-prefix")


def _statuses(fn: Callable) -> Callable:
    """Answer a ServiceError raised by the handler with its status code and message."""
    @functools.wraps(fn)
    async def handler(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except ServiceError as exc:
            await context.abort(status_code(exc.kind), exc.message)
    return handler


def status_code(kind: ErrorKind) -> grpc.StatusCode:
    """This door's status for a refusal's kind: the gRPC code of the same name."""
    return grpc.StatusCode[kind.name]


def _parsed(message: Any) -> Any:
    if isinstance(message, Unparseable):
        raise invalid(message.describe())
    return message


def _metadata(context: grpc.aio.ServicerContext, method: str = "") -> dict[str, str]:
    """What a telemetry layer may want from the call: the door, the peer and trace context; `method`: the RPC, where
    the request's kind does not say it (Classify and EmbedSparse are embedding jobs: the access log names them)."""
    out = {"door": "grpc", "peer": context.peer() or ""}
    if method:
        out["method"] = method
    for key, value in context.invocation_metadata() or ():
        if key in _FORWARDED_METADATA and isinstance(value, str):
            out[key] = value
    return out


class TandemServicer:
    def __init__(self, core: CoreAPI, *, replica: str) -> None:
        self.core = core
        self.replica = replica
        self._streams = itertools.count()
        self._tasks: set[asyncio.Task] = set()  # per-request pumps, held until done
        self._sessions: set[StreamSession] = set()  # streams still being written

    async def delivered(self) -> None:
        """Return once every request's pump has handed its last message to its stream and every stream has
        written what it was given: after the engine has ended every request (a drain, an abort), what each client
        is owed is on the wire before the server cancels the calls that stay open."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))
        for session in list(self._sessions):
            await session.all_sent()

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
            self._check_new_id(session, client_id, Task.GENERATE, meta)
            stream = self.core.generate([generate_input(req)], meta, relayed=True)
        except ServiceError as exc:
            session.send(_generate_error(client_id, exc))
            return
        session.live[client_id] = stream.abort
        self._spawn(self._pump_generate(session, client_id, stream))

    @staticmethod
    async def _pump_generate(session: StreamSession, client_id: str, stream: AsyncIterator[GenerateEvent]) -> None:
        async for event in stream:
            if event.error is not None:
                session.send(_generate_error(client_id, event.error))
            else:
                session.send(generate_message(client_id, event.output, event.usage))
        session.finished(client_id)

    @staticmethod
    def _cancel(session: StreamSession, client_id: str) -> None:
        abort = session.live.get(client_id)
        if abort is None:
            session.send(_generate_error(client_id, ServiceError(
                ErrorKind.NOT_FOUND,
                f"cancel: no live request {client_id!r} on this stream (it finished already or never started)")))
            return
        abort()

    # ---- Rerank ----------------------------------------------------------------------------------

    @_statuses
    async def Rerank(self, request: Any, context: grpc.aio.ServicerContext) -> pb.RerankResponse:
        req = _parsed(request)
        return rerank_response(await self.core.rerank(rerank_input(req), _metadata(context)))

    @_statuses
    async def RerankStream(self, request_iterator: AsyncIterator, context: grpc.aio.ServicerContext) -> None:
        await self._serve_stream("rerank", request_iterator, context, self._start_rerank)

    def _start_rerank(self, session: StreamSession, req: pb.RerankRequest, meta: dict) -> None:
        client_id = req.request_id
        try:
            self._check_new_id(session, client_id, Task.RERANK, meta)
            inp = rerank_input(req)
        except ServiceError as exc:
            session.send(pb.RerankStreamResponse(request_id=client_id, error=_request_error(exc)))
            return
        task = self._spawn(self._pump_rerank(session, inp, meta))
        session.live[client_id] = task.cancel

    async def _pump_rerank(self, session: StreamSession, inp: RerankInput, meta: dict) -> None:
        try:
            response = rerank_response(await self.core.rerank(inp, meta))
            session.send(pb.RerankStreamResponse(request_id=inp.request_id, response=response))
        except ServiceError as exc:
            session.send(pb.RerankStreamResponse(request_id=inp.request_id, error=_request_error(exc)))
        finally:
            session.finished(inp.request_id)

    # ---- streams (Generate, RerankStream) --------------------------------------------------------

    def _check_new_id(self, session: StreamSession, client_id: str, kind: Task, meta: dict) -> None:
        """Ids are given and unique among a stream's unfinished requests (a stream is this door's own idea); a
        refusal here is told to the core API's hooks, as its own refusals are."""
        error = None
        if not client_id:
            error = invalid("request_id must be a non-empty string")
        elif client_id in session.live:
            error = ServiceError(ErrorKind.ALREADY_EXISTS,
                                 f"request_id {client_id!r} is already live on this stream; ids must be unique "
                                 "among a stream's unfinished requests (the earlier request goes on)")
        if error is not None:
            self.core.refused(kind, client_id, meta, error)
            raise error

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _serve_stream(self, kind: str, requests: AsyncIterator, context: grpc.aio.ServicerContext,
                            on_message: Callable[[StreamSession, Any, dict], None]) -> None:
        """One bidirectional stream: a reader task hands each client message to `on_message` (which admits it
        through the core API) while this writes the session's messages; when the writing ends (input done and
        answered, the stream failed, the client left) the reader stops and the stream's live requests are
        aborted."""
        session = StreamSession(self.core.limits.max_stream_buffer_bytes)
        meta = {**_metadata(context), "stream": f"{kind}-{next(self._streams)}"}
        reader = asyncio.create_task(self._read_stream(requests, session, meta, on_message))
        self._sessions.add(session)
        try:
            async for message in session.messages():
                await context.write(message)
        finally:
            self._sessions.discard(session)
            session.closed()
            reader.cancel()
            session.abort_all()

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

    # ---- Embed -----------------------------------------------------------------------------------

    @_statuses
    async def Embed(self, request: Any, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        req = _parsed(request)
        return embed_response(await self.core.embed(embed_input(req), _metadata(context)))

    # ---- the kinds served by an encoder of their own (classification, sparse embeddings) ----------------------

    def pooled(self, kind: Kind) -> Callable:
        """The unary handler of pooled kind `kind`'s RPC (handlers.py registers one for each kind in
        service/kinds.py pooled()): its request's texts (or text pairs) to CoreAPI.pool, its outcome to its response
        message (pooled_response, one builder for every pooled kind)."""
        respond = pooled_response(kind)

        async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                req = _parsed(request)
                return respond(await self.core.pool(kind.task, _texts_input(req),
                                                    _metadata(context, kind.grpc_method)))
            except ServiceError as exc:
                await context.abort(status_code(exc.kind), exc.message)
        handler.__name__ = kind.grpc_method
        return handler

    # ---- ModelInfo -------------------------------------------------------------------------------

    @_statuses
    async def ModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        _parsed(request)
        info = self.core.info
        return pb.ModelInfoResponse(
            model=info.model, served_names=list(info.served_names), architecture=info.architecture,
            max_model_len=info.max_model_len, block_size=info.block_size, kv_blocks_total=info.kv_blocks_total,
            reranker=info.reranker, rerank_mode=info.rerank_mode, device=info.device, dtype=info.dtype,
            replica=self.replica, weight_format=info.weight_format, weight_bytes=info.weight_bytes,
            vocab_size=info.vocab_size, rerank_max_pair_tokens=info.rerank_max_pair_tokens,
            rerank_limit_by=info.rerank_limit_by, cpu_kernels=info.cpu_kernels, embedder=info.embedder,
            embedding_dimensions=info.embedding_dimensions, embedder_max_tokens=info.embedder_max_tokens,
            embedder_matryoshka=info.embedder_matryoshka, rerank_dtype=info.rerank_dtype,
            embedder_dtype=info.embedder_dtype,
            models=[pb.ServedModel(name=m.name, tasks=[t.value for t in m.tasks], max_tokens=m.max_tokens)
                    for m in self.core.models()],
            limits=pb.Limits(max_waiting=info.max_waiting, max_documents=info.max_documents,
                             max_embed_inputs=info.max_embed_inputs, max_message_bytes=info.max_message_bytes, max_n=info.max_n,
                             max_logprobs=info.max_logprobs))




# ---- protobuf in -----------------------------------------------------------------------------------

# Fields with presence: unset takes the engine's default, so 0 can be refused where it is not a valid value.
_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "logprobs", "prompt_logprobs",
                      "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "min_tokens",
                      "skip_special_tokens")


def generate_input(req: pb.GenerateRequest) -> GenerateInput:
    which = req.WhichOneof("input")
    prompt: str | list[int] | None = None
    messages = None
    if which == "prompt":
        prompt = req.prompt
    elif which == "token_ids":
        prompt = list(req.token_ids.ids)
    elif which == "messages":
        messages = [{"role": m.role, "content": m.content} for m in req.messages.messages]
    return GenerateInput(req.request_id, sampling_params(req.params), prompt=prompt, messages=messages,
                         model=req.model, timeout_ms=req.timeout_ms)


def sampling_params(msg: pb.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams; whatever it refuses is INVALID_ARGUMENT with its message (naming the field)."""
    kwargs: dict[str, Any] = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING if msg.HasField(name)}
    kwargs.setdefault("max_tokens", None)  # unset: the rest of the context (SamplingParams' None)
    try:
        return SamplingParams(stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                              ignore_eos=msg.ignore_eos, priority=msg.priority,
                              logit_bias=dict(msg.logit_bias) or None,
                              structured_outputs=_structured_outputs(msg), **kwargs)
    except ValueError as exc:
        raise invalid(str(exc)) from None


def _structured_outputs(msg: pb.SamplingParams) -> StructuredOutputsParams | None:
    """The response_format oneof; a json_schema that is not a JSON object is refused here, before the engine."""
    which = msg.WhichOneof("response_format")
    if which == "json_schema":
        return StructuredOutputsParams(json=json_schema(msg.json_schema, "response_format.json_schema"),
                                       source="response_format.json_schema")
    if which == "regex":
        return StructuredOutputsParams(regex=msg.regex, source="response_format.regex")
    if which == "choice":
        return StructuredOutputsParams(choice=list(msg.choice.choices), source="response_format.choice")
    return None


def rerank_input(req: pb.RerankRequest) -> RerankInput:
    try:
        params = RerankParams(truncate="none" if req.truncate == pb.TRUNCATE_NONE else "end",
                              instruction=req.instruction if req.HasField("instruction") else None,
                              priority=req.priority,
                              max_windows=req.max_windows if req.HasField("max_windows") else None)
        return RerankInput(req.request_id, req.query, list(req.documents), params, model=req.model,
                           top_n=req.top_n if req.HasField("top_n") else None,
                           return_documents=req.return_documents)
    except ValueError as exc:
        raise invalid(str(exc)) from None


def embed_input(req: pb.EmbedRequest) -> EmbedInput:
    if req.texts and req.token_ids:
        raise invalid("give either texts or token_ids, not both")
    try:
        params = EmbedParams(normalize=req.normalize if req.HasField("normalize") else True,
                             dimensions=req.dimensions if req.HasField("dimensions") else None,
                             truncate=req.truncate != pb.TRUNCATE_NONE,
                             truncation_direction="left" if req.truncate_start else "right", priority=req.priority)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    inputs = list(req.texts) if req.texts else [list(t.ids) for t in req.token_ids]
    return EmbedInput("", inputs, params, model=req.model)


def _texts_input(req: Any) -> EmbedInput:
    """A pooled kind's request (ClassifyRequest, EmbedSparseRequest): its texts (or text pairs, where it has them)
    as the core's EmbedInput (the core sets the task), with what else it says of EmbedParams (a ClassifyRequest's
    raw_scores): a field named as an EmbedParams field means that field."""
    extra = {f.name: getattr(req, f.name) for f in req.DESCRIPTOR.fields if f.name in _EXTRA_PARAMS
             and (not f.has_presence or req.HasField(f.name))}
    try:
        p = EmbedParams(truncate=req.truncate != pb.TRUNCATE_NONE, priority=req.priority, **extra)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    pairs = [(x.text, x.text_pair) for x in getattr(req, "pairs", ())]
    if pairs and req.texts:
        raise invalid("give texts or pairs, not both")
    return EmbedInput("", pairs or list(req.texts), p, model=req.model)


_EXTRA_PARAMS = {f.name for f in dataclasses.fields(EmbedParams)} - {"truncate", "priority", "task"}


# ---- protobuf out ----------------------------------------------------------------------------------

_FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
           FinishReason.ABORT: pb.FINISH_REASON_ABORT}


def _usage(usage: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                    completion_tokens=usage.completion_tokens, time_to_first_token_s=usage.time_to_first_token_s,
                    duration_s=usage.duration_s)


def generate_message(client_id: str, out: TokenDelta, usage: Usage | None) -> pb.GenerateServerMessage:
    """A delta, or the final message when `out` ends the request (with n > 1: the last completion to end)."""
    fields = dict(text=out.text, token_ids=out.new_token_ids, index=out.index,
                  finish_reason=_FINISH.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
                  logprobs=[_token_logprobs(lp, token) for lp, token in zip(out.logprobs or (), out.new_token_ids)],
                  prompt_logprobs=[_token_logprobs(lp) for lp in out.prompt_logprobs or ()])
    if not out.finished:
        return pb.GenerateServerMessage(request_id=client_id, delta=pb.TokenDelta(**fields))
    return pb.GenerateServerMessage(request_id=client_id, final=pb.GenerateFinal(**fields, usage=_usage(usage)))


def _token_logprobs(logprobs: Logprobs | None, chosen: int | None = None) -> pb.TokenLogprobs:
    """One position: the chosen token first (for a prompt position, the engine's first entry), then the others,
    most likely first. None (the first prompt token) is an empty entry."""
    if not logprobs:
        return pb.TokenLogprobs()
    if chosen is None:
        chosen = next(iter(logprobs))
    first = [chosen] if chosen in logprobs else []
    rest = sorted((t for t in logprobs if t != chosen), key=lambda t: -logprobs[t])
    return pb.TokenLogprobs(entries=[pb.TokenLogprob(token_id=t, logprob=logprobs[t]) for t in first + rest])


def _request_error(error: ServiceError) -> pb.RequestError:
    return pb.RequestError(code=error.kind.value, message=error.message)  # the google.rpc.Code number


def _generate_error(client_id: str, error: ServiceError) -> pb.GenerateServerMessage:
    return pb.GenerateServerMessage(request_id=client_id, error=_request_error(error))


def rerank_response(outcome: RerankOutcome) -> pb.RerankResponse:
    results = [pb.RerankResult(index=r.index, score=r.score, document=r.document, document_tokens=r.document_tokens,
                               truncated=r.truncated, windows=r.windows) for r in outcome.results]
    return pb.RerankResponse(request_id=outcome.request_id, results=results, usage=_usage(outcome.usage),
                             mode=str(outcome.mode), model=outcome.model)


def items_field(response: Descriptor) -> FieldDescriptor:
    """A pooled kind's response's one repeated message field: its items, one per input, input order."""
    found = [f for f in response.fields if f.is_repeated and f.message_type is not None
             and not f.message_type.GetOptions().map_entry]
    if len(found) != 1:
        raise TypeError(f"{response.full_name} has {len(found)} repeated message fields: a pooled kind's response "
                        "repeats one item message, one per input")
    return found[0]


def pooled_response(kind: Kind) -> Callable[[PooledOutcome], Message]:
    """Pooled kind `kind`'s response message from its outcome, built the same way for every such kind: its type is
    its RPC's (read off the service descriptor, as handlers.py registers it); the one repeated message field in it
    (items_field) gets one item per input, input order, filled from the kind's plain data (service/kinds.py
    `grpc_item`: the output's fields) and `truncated`; then `model` and `usage`. The message's constructor fills
    nested messages from dicts, and refuses a field the message has not (ValueError) or a value of the wrong type
    (TypeError)."""
    _, response = rpc_types(kind.grpc_method)
    field, item = items_field(response.DESCRIPTOR), kind.grpc_item
    if item is None or "truncated" not in field.message_type.fields_by_name:
        raise TypeError(f"{kind.grpc_method}'s response cannot be built: it needs its kind's grpc_item "
                        f"(service/kinds.py) and a `truncated` field in {field.message_type.full_name}")
    items = field.name

    def build(outcome: PooledOutcome) -> Message:
        return response(**{items: [{**item(output, outcome.labels), "truncated": truncated}
                                   for output, truncated in zip(outcome.outputs, outcome.truncated)]},
                        model=outcome.model, usage=_usage(outcome.usage))
    return build


def embed_response(outcome: EmbedOutcome) -> pb.EmbedResponse:
    return pb.EmbedResponse(embeddings=[pb.Embedding(values=v, truncated=t)
                                        for v, t in zip(outcome.embeddings, outcome.truncated)],
                            model=outcome.model, usage=_usage(outcome.usage))
