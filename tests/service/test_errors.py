"""Bad requests get the status code and message documented in service/errors.py; the server keeps serving."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import grpc
import pytest

from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from tests.service.conftest import MAX_DOCUMENTS, MAX_MESSAGE_BYTES, MAX_MODEL_LEN, UNENDING
from service.errors import ErrorKind
from service.servicer import status_code

INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


def _gen(request_id: str = "r", *, prompt: str | None = "Hello", params: dict | None = None,
         **fields) -> pb.GenerateClientMessage:
    request = pb.GenerateRequest(request_id=request_id, params=pb.SamplingParams(**(params or {})), **fields)
    if prompt is not None and not any(k in fields for k in ("messages", "token_ids")):
        request.prompt = prompt
    return pb.GenerateClientMessage(request=request)


def _cancel(request_id: str) -> pb.GenerateClientMessage:
    return pb.GenerateClientMessage(cancel=pb.CancelRequest(request_id=request_id))


def _invalid_utf8_chat() -> bytes:
    message = _gen("utf8", prompt=None, messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user",
                                                                                       content="caf\u00e9")]))
    data = message.SerializeToString()
    return data.replace("caf\u00e9".encode(), b"caf\xff\xfe")  # same length, no longer UTF-8


@dataclass
class Case:
    name: str
    code: grpc.StatusCode
    message: str  # must appear in the status message
    stream: list = field(default_factory=list)  # Generate messages, in order; the error is the first one received
    rerank: pb.RerankRequest | None = None  # or a unary Rerank
    raw: bytes | None = None  # or raw bytes on a Generate stream (the whole stream fails)


CASES = [
    Case("cancel of an unknown id", NOT_FOUND, "cancel: no live request 'ghost' on this stream",
         stream=[_cancel("ghost")]),
    Case("duplicate id on one stream", grpc.StatusCode.ALREADY_EXISTS, "request_id 'dup' is already live",
         stream=[_gen("dup", params=dict(max_tokens=UNENDING, ignore_eos=True)), _gen("dup")]),
    Case("empty request id", INVALID, "request_id must be a non-empty string", stream=[_gen("")]),
    Case("no input", INVALID, "request has no input: set prompt, messages or token_ids", stream=[_gen(prompt=None)]),
    Case("empty prompt", INVALID, "prompt must not be empty", stream=[_gen(prompt="")]),
    Case("negative max_tokens", INVALID, "max_tokens must be an integer >= 1, got -1",
         stream=[_gen(params=dict(max_tokens=-1))]),
    Case("max_tokens past the context", INVALID, "max_tokens is too large: 1000000; the prompt has 6 tokens and "
         "max_model_len is 8192, so max_tokens can be at most 8186",
         stream=[_gen(prompt=None, token_ids=pb.TokenIds(ids=[42] * 6), params=dict(max_tokens=10**6))]),
    Case("NaN temperature", INVALID, "temperature must be a finite number >= 0, got nan",
         stream=[_gen(params=dict(temperature=math.nan))]),
    Case("top_p out of range", INVALID, "top_p must be in (0, 1]", stream=[_gen(params=dict(top_p=1.5))]),
    Case("unknown model", NOT_FOUND, "model 'gpt-4' is not served by this replica", stream=[_gen(model="gpt-4")]),
    Case("bad token ids", INVALID, "prompt token ids must be integers in [0, 49152)",
         stream=[_gen(prompt=None, token_ids=pb.TokenIds(ids=[1, 2, 10**6]))]),
    Case("prompt longer than the context", INVALID, "max_model_len is 8192",
         stream=[_gen(prompt=None, token_ids=pb.TokenIds(ids=[42] * 9000))]),
    Case("chat message without a role", INVALID, "messages[0].role must not be empty",
         stream=[_gen(prompt=None, messages=pb.ChatMessages(messages=[pb.ChatMessage(content="hi")]))]),
    Case("no chat messages", INVALID, "messages must be a non-empty list",
         stream=[_gen(prompt=None, messages=pb.ChatMessages())]),
    Case("empty client message", INVALID, "empty client message: set request or cancel",
         stream=[pb.GenerateClientMessage()]),
    Case("invalid UTF-8 in chat", INVALID, "could not parse tandem.v1.GenerateClientMessage", raw=_invalid_utf8_chat()),
    Case("empty query", INVALID, "query must be a non-empty string",
         rerank=pb.RerankRequest(query="", documents=["a"])),
    Case("zero documents", INVALID, "documents must be a non-empty list",
         rerank=pb.RerankRequest(query="q", documents=[])),
    Case("too many documents", INVALID, f"documents has {MAX_DOCUMENTS + 1} items; this server takes at most "
         f"{MAX_DOCUMENTS}", rerank=pb.RerankRequest(query="q", documents=["d"] * (MAX_DOCUMENTS + 1))),
    Case("top_n below 1", INVALID, "top_n must be >= 1, got 0", rerank=pb.RerankRequest(query="q", documents=["a"],
                                                                                        top_n=0)),
    Case("document too long with truncate NONE", INVALID, "documents[0] with the query is",
         rerank=pb.RerankRequest(query="q", documents=["word " * (MAX_MODEL_LEN + 100)],
                                 truncate=pb.TRUNCATE_NONE)),
    Case("a chat role no API knows", INVALID, "messages[0].role must be one of system, user, assistant, tool, "
         "developer; got 'wizard'", stream=[_gen(prompt=None, messages=pb.ChatMessages(
             messages=[pb.ChatMessage(role="wizard", content="hi")]))]),
    Case("oversize message", grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max",
         rerank=pb.RerankRequest(query="q", documents=["x" * (MAX_MESSAGE_BYTES + 1)])),
]


async def _stream_error(stub: pb_grpc.TandemStub, messages: list) -> tuple[grpc.StatusCode, str]:
    """Send messages on a Generate stream; the first error reply; then prove the stream still serves."""
    call = stub.Generate()
    for message in messages:
        await call.write(message)
    while (reply := await call.read()).WhichOneof("kind") != "error":
        pass
    code = next(c for c in grpc.StatusCode if c.value[0] == reply.error.code)
    text = reply.error.message
    for message in messages:  # stop anything the case started (unknown ids just get NOT_FOUND)
        if message.WhichOneof("kind") == "request" and message.request.request_id:
            await call.write(_cancel(message.request.request_id))
    await call.write(_gen("after", params=dict(max_tokens=1)))
    await call.done_writing()
    finals = []
    while (reply := await call.read()) is not grpc.aio.EOF:
        finals += [reply.WhichOneof("kind")] if reply.request_id == "after" else []
    assert finals[-1] == "final"  # the same stream keeps working
    return code, text


async def _rpc_error(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_bad_request_gets_documented_status(served, case: Case):
    await asyncio.wait_for(_check(served, case), 120)  # a missing error must fail, not hang


async def _check(served, case: Case) -> None:
    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = pb_grpc.TandemStub(channel)
        if case.stream:
            code, message = await _stream_error(stub, case.stream)
        elif case.rerank is not None:
            code, message = await _rpc_error(stub.Rerank(case.rerank))
        else:
            raw = channel.stream_stream("/tandem.v1.Tandem/Generate", request_serializer=lambda b: b,
                                        response_deserializer=pb.GenerateServerMessage.FromString)
            call = raw(iter([case.raw]))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call:
                    pass
            code, message = info.value.code(), info.value.details()
        assert code is case.code, message
        assert case.message in message
        # the server keeps serving: a fresh call on the same channel works end to end
        results = (await stub.Rerank(pb.RerankRequest(query="capital of France", documents=["Paris"]))).results
        assert [r.index for r in results] == [0]


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_each_kind_of_refusal_is_the_grpc_status_of_its_name_and_number(kind):
    """The core's door-neutral kinds reach gRPC clients as the status of the same name, and a RequestError on a
    stream carries the same google.rpc.Code number."""
    code = status_code(kind)
    assert code.name == kind.name and code.value[0] == kind.value
