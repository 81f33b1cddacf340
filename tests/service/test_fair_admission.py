"""Fair admission through the service: one Generate stream that writes request after request without reading its
answers gets RESOURCE_EXHAUSTED for its own requests once it holds its share of --max-waiting, while another
client's Generate stream and an HTTP request are still admitted and served; nothing is left once the flood is
cancelled. The engine runs one sequence at a time and one unending generation holds it, so everything else
admitted waits (the state these tests wait on, never a sleep)."""
from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from service.server import ServerConfig
from tests.reliability.tiny import make_tiny_model_dir, tiny_engine
from tests.service.harness import ServerThread, assert_all_blocks_free

MAX_WAITING = 8
FLOOD = 3 * MAX_WAITING  # requests the flood writes before it reads anything
MAX_MODEL_LEN = 8192
UNENDING = MAX_MODEL_LEN - 256  # thousands of decode steps: the test cancels it long before it could end
GUARD_S = 120.0  # a hang guard, not a speed bound


@pytest.fixture(scope="module")
def one_seat(tmp_path_factory):
    engine = tiny_engine(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-fair")), num_kv_blocks=MAX_MODEL_LEN // 8,
                         block_size=16, max_num_seqs=1, max_model_len=MAX_MODEL_LEN)
    config = ServerConfig(host="127.0.0.1", port=0)
    server = ServerThread(engine, config, max_waiting=MAX_WAITING)
    http = server.add_http(config)
    yield server, http
    server.close()


def _request(request_id: str, max_tokens: int) -> pb.GenerateClientMessage:
    return pb.GenerateClientMessage(request=pb.GenerateRequest(
        request_id=request_id, prompt="Tell me about the ocean.",
        params=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


async def _read_until(call, request_id: str, kinds: tuple[str, ...]) -> pb.GenerateServerMessage:
    while True:
        message = await asyncio.wait_for(call.read(), GUARD_S)
        assert message is not grpc.aio.EOF
        if message.request_id == request_id and message.WhichOneof("kind") in kinds:
            return message


async def _refusals_before(call, marker: str) -> list[pb.GenerateServerMessage]:
    """The errors the stream receives before the answer to a cancel of `marker` (an id never sent: NOT_FOUND), which
    the server sends after it has handled every message written before it."""
    errors = []
    while True:
        message = await asyncio.wait_for(call.read(), GUARD_S)
        assert message is not grpc.aio.EOF
        if message.request_id == marker:
            assert message.error.code == grpc.StatusCode.NOT_FOUND.value[0]
            return errors
        if message.WhichOneof("kind") == "error":
            errors.append(message)


async def _until_waiting(server: ServerThread, count: int) -> None:
    """Wait until `count` requests wait for the engine (a state, polled on the server's loop; a hang guard only)."""
    async def waiting() -> None:
        while server.bridge.num_waiting != count:
            await asyncio.sleep(0.01)
    await server.acall(asyncio.wait_for(waiting(), GUARD_S))


async def test_a_flooding_stream_is_refused_its_excess_and_other_clients_are_served(one_seat):
    server, http = one_seat
    share = MAX_WAITING // 2  # a lone client's share (EngineBridge.fair_share)
    async with grpc.aio.insecure_channel(server.address) as channel, \
            httpx.AsyncClient(base_url=http.url, timeout=GUARD_S) as client:
        stub = pb_grpc.TandemStub(channel)
        flood = stub.Generate()
        await flood.write(_request("running", UNENDING))
        await _read_until(flood, "running", ("delta",))  # it holds the engine's one sequence slot
        for i in range(FLOOD):
            await flood.write(_request(f"flood-{i}", 2))
        await flood.write(pb.GenerateClientMessage(cancel=pb.CancelRequest(request_id="marker")))
        refused = await _refusals_before(flood, "marker")
        assert {m.request_id for m in refused} == {f"flood-{i}" for i in range(share, FLOOD)}
        assert all(m.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] for m in refused)
        assert "over its share of the waiting queue" in refused[0].error.message
        assert server.bridge.num_waiting == share

        other = stub.Generate()
        await other.write(_request("other", 2))
        completion = asyncio.create_task(client.post("/v1/completions", json={
            "prompt": "Hello", "max_tokens": 2, "ignore_eos": True}))
        await _until_waiting(server, share + 2)  # both admitted while the flood is still over its share

        await flood.write(pb.GenerateClientMessage(cancel=pb.CancelRequest(request_id="running")))
        final = (await _read_until(other, "other", ("final", "error"))).final
        assert final.usage.completion_tokens == 2
        response = await completion
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
        await other.done_writing()
        flood.cancel()  # the flood leaves without reading the rest
    assert_all_blocks_free(await server.idle_stats())
