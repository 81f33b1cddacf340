"""StreamSession's delivery bookkeeping: what a stopping server waits on before it cancels the open calls; and the one
bound of a stream (a relayed core stream counts nothing, a bounded one overflows on its own)."""
import asyncio

from engine.outputs import TokenDelta
from proto import tandem_pb2 as pb
from service.core import GenerationStream
from service.errors import ErrorKind
from service.lifecycle import RequestLifecycle
from service.session import StreamSession


def _message(i: int) -> pb.RerankStreamResponse:
    return pb.RerankStreamResponse(request_id=f"r{i}")


async def test_all_sent_waits_until_the_writer_has_written_every_queued_message():
    session = StreamSession()
    await asyncio.wait_for(session.all_sent(), 5)  # nothing queued: done at once
    session.send(_message(0))
    session.send(_message(1))
    waiter = asyncio.create_task(session.all_sent())
    writer = session.messages()
    assert (await writer.__anext__()).request_id == "r0"
    await asyncio.sleep(0)
    assert not waiter.done()  # r0 is being written, r1 queued
    assert (await writer.__anext__()).request_id == "r1"  # r0 written
    await asyncio.sleep(0)
    assert not waiter.done()  # r1 is being written
    session.finished("r1")
    session.end_of_input()
    assert [m async for m in writer] == []  # the writer asks for more: r1 is written, the stream ends
    await asyncio.wait_for(waiter, 5)


async def test_a_closed_or_overflowed_stream_owes_nothing():
    session = StreamSession()
    session.send(_message(0))
    session.closed()  # the call was cancelled: nothing more will be written
    await asyncio.wait_for(session.all_sent(), 5)

    small = StreamSession(max_buffer_bytes=1)
    small.send(_message(1))
    small.send(_message(2))  # over the buffer: the queue is dropped, the stream fails
    assert small.overflowed
    await asyncio.wait_for(small.all_sent(), 5)


class _Bridge:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, engine_id: str) -> None:
        self.aborted.append(engine_id)


def _stream(bridge: _Bridge, max_buffer_bytes: int | None) -> tuple[GenerationStream, object]:
    stream = GenerationStream(bridge, max_buffer_bytes)
    stream._admitted("c", RequestLifecycle(engine_id="e0", client_id="c", kind="generate"))
    return stream, stream.sink(0, "c")


def _token(i: int, finished: bool = False) -> TokenDelta:
    return TokenDelta("e0", new_token_ids=[i], text="x" * 100, finished=finished)


async def test_a_relayed_core_stream_counts_nothing_and_a_bounded_one_overflows_alone():
    """One bound per stream: the gRPC door relays a generation's core stream (it counts no bytes, never overflows:
    the session's outbox is the bound), the HTTP door reads a bounded one (its overflow aborts its request)."""
    bridge = _Bridge()
    relayed, put_relayed = _stream(bridge, None)
    bounded, put_bounded = _stream(bridge, 1024)
    for i in range(50):  # ~180 bytes each: 9 KB, far over 1 KiB
        put_relayed(_token(i, finished=i == 49))
        put_bounded(_token(i, finished=i == 49))
    assert bridge.aborted == ["e0"]  # the bounded stream's overflow, once; the relayed one aborted nothing
    assert [e.output.new_token_ids[0] async for e in relayed] == list(range(50))
    events = [e async for e in bounded]
    assert len(events) == 1 and events[0].error.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert "stream buffer full" in events[0].error.message
