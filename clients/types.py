"""What the clients hand back: deltas, usage, rerank results, and the one error type."""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from proto import tandem_pb2 as pb

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    time_to_first_token_s: float = 0.0  # measured by the server from arrival
    duration_s: float = 0.0

    @classmethod
    def from_proto(cls, msg: pb.Usage) -> "Usage":
        return cls(msg.prompt_tokens, msg.cached_tokens, msg.completion_tokens, msg.time_to_first_token_s,
                   msg.duration_s)


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of one generation; the last one has finish_reason ("stop" | "length" | "abort") and usage."""
    request_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    replica: str | None = None  # the serving replica (x-tandem-replica), when the server named it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RerankResult:
    index: int  # position in the documents sent
    score: float
    document: str | None = None  # set when return_documents=True


class RerankResults(list):
    """RerankResult items sorted by score (highest first), plus the request's usage and serving replica."""
    usage: Usage | None = None
    replica: str | None = None  # x-tandem-replica of the replica that answered


class TandemError(Exception):
    """A request the server refused or failed: a grpc status code and the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str, request_id: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id

    @classmethod
    def from_rpc(cls, error: grpc.RpcError, request_id: str = "") -> "TandemError":
        return cls(error.code(), error.details() or "", request_id)


def status_code(number: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return code
    return grpc.StatusCode.UNKNOWN
