"""Drain with a grace period (--drain-grace): health says NOT_SERVING first while new work is still served, so a
load balancer can stop routing before anything is refused; then new work is refused and the server stops.

The grace is the test's to end (end_grace(), what a second SIGTERM does), so neither the model's speed nor the
machine's load decides whether the rerank lands inside it."""
from __future__ import annotations

import asyncio
import contextlib

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from service.server import ServerConfig
from tests.reliability.tiny import tiny_engine
from tests.service.harness import ServerThread


async def test_not_serving_comes_before_refusing(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=64, block_size=16)
    server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0, drain_grace_s=3600.0, drain_timeout_s=60.0))
    try:
        drained = server.call(server.server.drain())
        async with grpc.aio.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING:
                await asyncio.sleep(0.01)
            # NOT_SERVING (what /healthz reads too), and still serving new work during the grace.
            assert not server.server.serving and not server.bridge.draining
            ranked = await pb_grpc.TandemStub(channel).Rerank(pb.RerankRequest(query="blue", documents=["sky"]))
            assert len(ranked.results) == 1
            assert not server.bridge.draining  # still inside the grace: only the test ends it

            async def end_grace() -> None:
                server.server.end_grace()
            await server.acall(end_grace())
        await asyncio.wrap_future(drained)
        assert server.bridge.draining  # after the grace: refusing (tests/service/test_process.py: UNAVAILABLE)
    finally:
        server.close()


async def test_a_drain_its_timeout_cuts_stops_within_the_margin_not_after_the_stop_grace(tiny_model_dir):
    """Once the drain timeout has aborted in-flight work, the stop takes no stop grace (here an hour: waiting on it
    would trip the hang guard) while the aborted generation's last message still reaches its client, whose stream is
    still open, before the transport closes."""
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=512, block_size=16, max_model_len=4096)
    server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0, drain_timeout_s=0.5, stop_grace_s=3600.0))
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = pb_grpc.TandemStub(channel).Generate()
            await call.write(pb.GenerateClientMessage(request=pb.GenerateRequest(
                request_id="long", prompt="Tell me about the sea.",
                params=pb.SamplingParams(max_tokens=4000, ignore_eos=True))))
            first = await asyncio.wait_for(call.read(), 120)
            assert first.WhichOneof("kind") == "delta"
            drained = server.call(server.server.drain())  # the stream stays open: the client never half-closes
            await asyncio.wait_for(asyncio.wrap_future(drained), 120)  # a hang guard, not a speed bound
            messages = [first]
            with contextlib.suppress(grpc.aio.AioRpcError):  # the stop cancels the open stream once it is answered
                while (message := await asyncio.wait_for(call.read(), 120)) is not grpc.aio.EOF:
                    messages.append(message)
        final = messages[-1]
        assert final.request_id == "long" and final.WhichOneof("kind") == "final"
        assert final.final.finish_reason == pb.FINISH_REASON_ABORT
        assert final.final.usage.completion_tokens < 4000
    finally:
        server.close()
