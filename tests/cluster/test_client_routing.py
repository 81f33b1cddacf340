"""Client side of scale-out against scripted stand-in servers (no engine): routing keys on every request,
one Generate stream per key, and generate retries only while nothing has streamed."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from clients import AsyncClient, Client, TandemError
from clients.aio import chat_routing_key, prefix_key
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]


class Scripted(pb_grpc.TandemServicer):
    """Records each Generate stream's x-tandem-prefix; answers requests by a script of outcomes per request."""

    def __init__(self, outcomes: list[str] = ()) -> None:
        self.outcomes = list(outcomes)  # "draining" | "break-after-delta" | "ok" (the default when empty)
        self.streams: list[str | None] = []  # x-tandem-prefix of each Generate stream, in order
        self.rerank_keys: list[str | None] = []

    def Generate(self, request_iterator, context):
        context.send_initial_metadata((("x-tandem-replica", f"stream-{len(self.streams)}"),))
        self.streams.append(dict(context.invocation_metadata()).get("x-tandem-prefix"))
        for message in request_iterator:
            if message.WhichOneof("kind") != "request":
                continue
            rid = message.request.request_id
            outcome = self.outcomes.pop(0) if self.outcomes else "ok"
            if outcome == "draining":
                yield pb.GenerateServerMessage(request_id=rid, error=pb.RequestError(
                    code=grpc.StatusCode.UNAVAILABLE.value[0], message="server is draining"))
                continue
            yield pb.GenerateServerMessage(request_id=rid, delta=pb.TokenDelta(text="a", token_ids=[1]))
            if outcome == "break-after-delta":
                context.abort(grpc.StatusCode.UNAVAILABLE, "replica went away")
            yield pb.GenerateServerMessage(request_id=rid, final=pb.GenerateFinal(
                text="b", token_ids=[2], finish_reason=pb.FINISH_REASON_LENGTH))

    def Rerank(self, request, context):
        context.send_initial_metadata((("x-tandem-replica", "rerank-replica"),))
        self.rerank_keys.append(dict(context.invocation_metadata()).get("x-tandem-prefix"))
        return pb.RerankResponse(results=[pb.RerankResult(index=0, score=0.5)])


@pytest.fixture
def scripted(fake_tandem_server):
    def start(outcomes: list[str] = ()) -> tuple[Scripted, str]:
        servicer = Scripted(outcomes)
        return servicer, fake_tandem_server(servicer)

    return start


def test_chat_key_is_shared_by_every_turn_and_differs_between_chats():
    later = CHAT + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "Another?"}]
    key = chat_routing_key(CHAT)
    assert len(key) == 16 and key == chat_routing_key(later)
    assert key != chat_routing_key([CHAT[0], {"role": "user", "content": "Name a square."}])
    assert key != chat_routing_key([{"role": "system", "content": "Be verbose."}, CHAT[1]])
    assert chat_routing_key([{"role": "system", "content": "x"}]) == ""  # no user turn: no key
    assert prefix_key("instr", "q") != prefix_key("instr", "q2")


async def test_generate_sends_one_stream_per_key_and_names_the_replica(scripted):
    servicer, target = scripted()
    later = CHAT + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "Another?"}]
    async with AsyncClient(target) as client:
        first = await client.complete(messages=CHAT)
        second = await client.complete(messages=later)  # same chat: same stream
        other = await client.complete(messages=[{"role": "user", "content": "Hello"}])
        raw = await client.complete("raw prompt")  # no key by default
        mine = await client.complete("raw prompt", routing_key="tenant-7")
        none = await client.complete(messages=CHAT, routing_key="")
    other_key = chat_routing_key([{"role": "user", "content": "Hello"}])
    # Four streams: the keyless one is shared by `raw` and `none`.
    assert servicer.streams == [chat_routing_key(CHAT), other_key, None, "tenant-7"]
    assert first.replica == second.replica == "stream-0" and other.replica == "stream-1"
    assert raw.replica == none.replica == "stream-2" and mine.replica == "stream-3"
    assert first.text == "ab" and first.finish_reason == "length"


async def test_rerank_sends_its_key_and_reports_the_replica(scripted):
    servicer, target = scripted()
    with Client(target) as client:
        results = client.rerank("q", ["d"], instruction="i")
        client.rerank("q", ["d"], routing_key="mine")
        client.rerank("q", ["d"], routing_key="")
    assert servicer.rerank_keys == [prefix_key("i", "q"), "mine", None]
    assert results.replica == "rerank-replica"


async def test_generate_refused_before_streaming_is_retried_on_a_new_stream(scripted):
    servicer, target = scripted(["draining", "draining"])
    async with AsyncClient(target, max_retries=3, backoff_s=0.01) as client:
        out = await client.complete(messages=CHAT)
        again = await client.complete(messages=CHAT)
    assert out.text == "ab" and out.replica == "stream-2"  # two refusals, each retiring its stream
    assert again.replica == "stream-2"  # the healthy stream is kept
    assert servicer.streams == [chat_routing_key(CHAT)] * 3


async def test_generate_retries_stop_at_max_retries(scripted):
    servicer, target = scripted(["draining"] * 3)
    async with AsyncClient(target, max_retries=2, backoff_s=0.01) as client:
        with pytest.raises(TandemError) as info:
            await client.complete("Hi")
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and len(servicer.streams) == 3


async def test_generate_that_streamed_text_is_not_retried(scripted):
    servicer, target = scripted(["break-after-delta"])
    async with AsyncClient(target, max_retries=3, backoff_s=0.01) as client:
        deltas = []
        with pytest.raises(TandemError) as info:
            async for delta in client.generate("Hi"):
                deltas.append(delta)
        assert info.value.code is grpc.StatusCode.UNAVAILABLE and [d.text for d in deltas] == ["a"]
        assert (await client.complete("Hi")).text == "ab"  # a broken stream is replaced
    assert len(servicer.streams) == 2


async def test_streams_beyond_max_streams_are_retired_least_recently_used_first(scripted):
    servicer, target = scripted()
    async with AsyncClient(target, max_streams=2) as client:
        for key in ("a", "b", "a", "c", "a", "b"):
            await client.complete("x", routing_key=key)
        await asyncio.sleep(0)
    assert servicer.streams == ["a", "b", "c", "b"]  # "b" was evicted by "c" and opened again
