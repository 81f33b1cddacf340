"""Standard grpc.health.v1 and server reflection, as off-the-shelf clients see them."""
from __future__ import annotations

import grpc
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


def test_health_client_gets_serving(served):
    with grpc.insecure_channel(served.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tandem.v1.Tandem"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service_and_resolves_its_methods(served):
    with grpc.insecure_channel(served.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert {"tandem.v1.Tandem", "grpc.health.v1.Health"} <= set(database.get_services())
        service = DescriptorPool(database).FindServiceByName("tandem.v1.Tandem")
        methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "Rerank", "RerankStream", "ModelInfo", "Embed", "Classify", "EmbedSparse"}
    assert methods["Embed"].output_type.full_name == "tandem.v1.EmbedResponse"
    generate = methods["Generate"]
    assert generate.input_type.full_name == "tandem.v1.GenerateClientMessage"
    assert generate.output_type.full_name == "tandem.v1.GenerateServerMessage"
    assert generate.client_streaming and generate.server_streaming
    assert not methods["Rerank"].client_streaming and methods["Rerank"].output_type.fields_by_name["results"]
