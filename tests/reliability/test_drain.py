"""Drain with a grace period (--drain-grace): health says NOT_SERVING first while new work is still served, so a
load balancer can stop routing before anything is refused; then new work is refused and the server stops.

The grace is the test's to end (end_grace(), what a second SIGTERM does), so neither the model's speed nor the
machine's load decides whether the rerank lands inside it."""
from __future__ import annotations

import asyncio

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
