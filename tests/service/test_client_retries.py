"""Client retry policy against a scripted stand-in server (no engine): UNAVAILABLE is retried, others are not."""
from __future__ import annotations


import grpc
import pytest

from clients import AsyncClient, TandemError
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc


class Scripted(pb_grpc.TandemServicer):
    """Rerank fails with the scripted codes in order, then answers."""

    def __init__(self, failures: list[grpc.StatusCode]) -> None:
        self.failures = list(failures)
        self.calls = 0
        self.prefixes: list[str] = []

    def Rerank(self, request, context):
        self.calls += 1
        self.prefixes.append(dict(context.invocation_metadata()).get("x-tandem-prefix", ""))
        if self.failures:
            context.abort(self.failures.pop(0), "scripted failure")
        return pb.RerankResponse(results=[pb.RerankResult(index=1, score=0.9), pb.RerankResult(index=0, score=0.1)])


@pytest.fixture
def scripted(fake_tandem_server):
    def start(failures: list[grpc.StatusCode]) -> tuple[Scripted, str]:
        servicer = Scripted(failures)
        return servicer, fake_tandem_server(servicer)

    return start


async def test_unavailable_is_retried_with_backoff(scripted):
    servicer, target = scripted([grpc.StatusCode.UNAVAILABLE] * 2)
    async with AsyncClient(target, max_retries=3, backoff_s=0.01) as client:
        results = await client.rerank("q", ["a", "b"])
    assert servicer.calls == 3
    assert [(r.index, r.score) for r in results] == [(1, 0.9), (0, 0.1)]
    assert len(set(servicer.prefixes)) == 1 and len(servicer.prefixes[0]) == 16  # same routing key every attempt


async def test_retries_stop_after_max_retries(scripted):
    servicer, target = scripted([grpc.StatusCode.UNAVAILABLE] * 5)
    async with AsyncClient(target, max_retries=2, backoff_s=0.01) as client:
        with pytest.raises(TandemError) as info:
            await client.rerank("q", ["a"])
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and servicer.calls == 3


async def test_other_codes_are_not_retried(scripted):
    servicer, target = scripted([grpc.StatusCode.INVALID_ARGUMENT])
    async with AsyncClient(target, max_retries=3, backoff_s=0.01) as client:
        with pytest.raises(TandemError) as info:
            await client.rerank("q", ["a"])
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT and servicer.calls == 1
