"""TLS and the bearer-token interceptor, on a second server that shares the test engine."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients import AsyncClient, TandemError
from proto import tandem_pb2 as pb
from proto import tandem_pb2_grpc as pb_grpc
from service.server import ServerConfig

DATA = Path(__file__).parent / "data"
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def secure(served):
    server = served.add_server(ServerConfig(host="127.0.0.1", port=0, tls_cert=str(DATA / "localhost.crt"),
                                            tls_key=str(DATA / "localhost.key"), auth_token=TOKEN))
    yield f"localhost:{server.address.rsplit(':', 1)[1]}"
    served.call(server.stop()).result(30)


def _root() -> bytes:
    return (DATA / "localhost.crt").read_bytes()


async def test_tls_with_the_token_serves(secure):
    async with AsyncClient(secure, root_certificates=_root(), token=TOKEN) as client:
        info = await client.model_info()
        final = await client.complete("Hello", max_tokens=2)
    assert info.limits.max_waiting > 0 and final.usage.completion_tokens >= 1


@pytest.mark.parametrize("token", [None, "wrong"])
async def test_missing_or_wrong_token_is_unauthenticated(secure, token):
    async with AsyncClient(secure, root_certificates=_root(), token=token) as client:
        with pytest.raises(TandemError) as unary:
            await client.model_info()
        with pytest.raises(TandemError) as stream:
            await client.complete("Hello", max_tokens=2)
    for error in (unary.value, stream.value):
        assert error.code is grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer <token>" in error.message


async def test_refusal_still_names_the_replica_and_health_needs_no_token(secure):
    credentials = grpc.ssl_channel_credentials(root_certificates=_root())
    async with grpc.aio.secure_channel(secure, credentials) as channel:
        refused = pb_grpc.TandemStub(channel).ModelInfo(pb.ModelInfoRequest())
        assert await refused.code() is grpc.StatusCode.UNAUTHENTICATED
        assert dict(await refused.initial_metadata())["x-tandem-replica"].endswith(secure.rsplit(":", 1)[1])
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
