"""StreamSession's delivery bookkeeping: what a stopping server waits on before it cancels the open calls."""
import asyncio

from proto import tandem_pb2 as pb
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
