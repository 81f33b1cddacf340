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


# Per position: token id -> log-probability; the chosen (or prompt) token first, then the alternatives by rank.
Logprobs = dict[int, float]


@dataclass(frozen=True, slots=True)
class Completion:
    """One of a request's n completions, whole (what `complete()` gathers per index)."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Logprobs] | None = None  # one per token, when logprobs was asked for


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of one completion (`index`, 0..n-1) of a generation.

    `finish_reason` ("stop" | "length" | "abort") is set on the delta where a completion ends; the request's
    last delta (`finished`) also carries the usage of the whole request. With n = 1 both are the last delta.
    """
    request_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    replica: str | None = None  # the serving replica (x-tandem-replica), when the server named it
    index: int = 0
    logprobs: list[Logprobs] | None = None  # one per token_ids entry, when logprobs was asked for
    # On the request's first delta, when prompt_logprobs was asked for: one per prompt token (None for the first).
    prompt_logprobs: list[Logprobs | None] | None = None
    # Only on what complete() returns: every completion, index order (text etc. above are completion 0's).
    outputs: list[Completion] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        """The request's last delta."""
        return self.usage is not None

    @classmethod
    def from_proto(cls, request_id: str, msg: "pb.TokenDelta | pb.GenerateFinal", replica: str | None,
                   final: bool) -> "Delta":
        reason = FINISH_REASONS.get(msg.finish_reason, "unknown") if final or msg.finish_reason else None
        return cls(request_id, msg.text, list(msg.token_ids), reason,
                   Usage.from_proto(msg.usage) if final else None, replica, msg.index,
                   [logprobs_dict(p) for p in msg.logprobs] or None,
                   [logprobs_dict(p) or None for p in msg.prompt_logprobs] or None)


def logprobs_dict(msg: pb.TokenLogprobs) -> Logprobs:
    return {e.token_id: e.logprob for e in msg.entries}


@dataclass(frozen=True, slots=True)
class RerankResult:
    index: int  # position in the documents sent
    score: float
    document: str | None = None  # set when return_documents=True
    document_tokens: int = 0  # the document's tokens the score saw (all of them unless truncated)
    truncated: bool = False  # the server cut the document to fit its rerank pair limit (truncate="end")
    windows: int = 1  # overlapping windows the server scored the document as (max_windows), its score the best


class RerankResults(list):
    """RerankResult items sorted by score (highest first), plus the request's usage and serving replica."""
    usage: Usage | None = None
    replica: str | None = None  # x-tandem-replica of the replica that answered
    mode: str = ""  # the rerank mode that scored them (likelihood, fusion, judge, cross-encoder)
    # The model that scored them, whatever the request named (RerankResponse.model): the embedder's id (dense), the
    # cross-encoder's, the LLM's served name (likelihood, judge), or "embedder+LLM" (fusion, cascade)
    model: str = ""


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
