"""Registers the Tandem servicer with deserializers that turn unparseable bytes into a value, not a crash.

grpc's generated registration parses with `FromString`; bytes that do not parse
(truncated, wrong wire types, invalid UTF-8 in a string field, nesting too deep)
then fail inside grpc.aio, which answers UNKNOWN (or INTERNAL). Here any parse
failure becomes an `Unparseable` the servicer answers with INVALID_ARGUMENT and
a message saying what was wrong; UNKNOWN and INTERNAL stay reserved for real
server faults (tests/reliability/test_fuzz.py holds every method to that).
"""
from __future__ import annotations

from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError, Message

from proto import tandem_pb2 as pb
from service.kinds import pooled

_SERVICE = pb.DESCRIPTOR.services_by_name["Tandem"]
SERVICE_NAME = _SERVICE.full_name


class Unparseable:
    """Bytes that are not a valid message of the expected type."""

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name = type_name
        self.error = error

    def describe(self) -> str:
        return (f"could not parse {self.type_name}: string fields must be valid UTF-8 and the bytes valid protobuf "
                f"({self.error})")


def _lenient(cls: type[Message]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Message | Unparseable:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Unparseable(cls.DESCRIPTOR.full_name, str(exc))
        except Exception as exc:  # whatever else a parser may raise is still the client's bytes, not our fault
            return Unparseable(cls.DESCRIPTOR.full_name, repr(exc))
    return parse


def rpc_types(method: str) -> tuple[type[Message], type[Message]]:
    """RPC `method`'s request and response message classes, read off the service descriptor."""
    rpc = _SERVICE.methods_by_name[method]
    return getattr(pb, rpc.input_type.name), getattr(pb, rpc.output_type.name)


def add_tandem_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Like the generated add_TandemServicer_to_server, with lenient request parsing."""
    handlers = {
        "Generate": grpc.stream_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_lenient(pb.GenerateClientMessage),
            response_serializer=pb.GenerateServerMessage.SerializeToString),
        "Rerank": grpc.unary_unary_rpc_method_handler(
            servicer.Rerank, request_deserializer=_lenient(pb.RerankRequest),
            response_serializer=pb.RerankResponse.SerializeToString),
        "RerankStream": grpc.stream_stream_rpc_method_handler(
            servicer.RerankStream, request_deserializer=_lenient(pb.RerankRequest),
            response_serializer=pb.RerankStreamResponse.SerializeToString),
        "Embed": grpc.unary_unary_rpc_method_handler(
            servicer.Embed, request_deserializer=_lenient(pb.EmbedRequest),
            response_serializer=pb.EmbedResponse.SerializeToString),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.ModelInfo, request_deserializer=_lenient(pb.ModelInfoRequest),
            response_serializer=pb.ModelInfoResponse.SerializeToString),
    }
    for kind in pooled():  # each kind served by an encoder of its own: one unary RPC, its types the service's
        request, response = rpc_types(kind.grpc_method)
        handlers[kind.grpc_method] = grpc.unary_unary_rpc_method_handler(
            servicer.pooled(kind), request_deserializer=_lenient(request),
            response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
