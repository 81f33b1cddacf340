"""Status codes the service answers with, and the error type that carries one.

Every refusal is a gRPC status code plus a message a person can act on. On a
`Generate` or `RerankStream` stream, a per-request refusal arrives as a
`RequestError` for that request id (same code and message) and the stream goes
on; on `Rerank` and `ModelInfo` it is the call's status.

| Situation                                         | Code               | Message (start)                                              |
|---------------------------------------------------|--------------------|--------------------------------------------------------------|
| cancel for an id with no live request             | NOT_FOUND          | `cancel: no live request 'ID' on this stream`                |
| request id already live on the same stream        | ALREADY_EXISTS     | `request_id 'ID' is already live on this stream`             |
| empty or missing request_id                       | INVALID_ARGUMENT   | `request_id must be a non-empty string`                      |
| no prompt, messages or token_ids                  | INVALID_ARGUMENT   | `request has no input: set prompt, messages or token_ids`    |
| empty prompt / empty token_ids                    | INVALID_ARGUMENT   | `prompt must not be empty`                                   |
| prompt longer than the context or the KV cache    | INVALID_ARGUMENT   | `prompt has N tokens; max_model_len is M ...`                |
| token id outside the vocabulary                   | INVALID_ARGUMENT   | `prompt token ids must be integers in [0, V)`                |
| chat message with an empty role                   | INVALID_ARGUMENT   | `messages[i].role must not be empty ...`                     |
| no chat messages                                  | INVALID_ARGUMENT   | `messages must be a non-empty list of {role, content}`       |
| max_tokens < 1                                    | INVALID_ARGUMENT   | `max_tokens must be an integer >= 1, got -1`                 |
| temperature NaN, infinite or < 0                  | INVALID_ARGUMENT   | `temperature must be a finite number >= 0, got nan`          |
| top_p outside (0, 1], top_k < -1                  | INVALID_ARGUMENT   | `top_p must be in (0, 1] ...` / `top_k must be ...`          |
| model names something this replica does not serve | NOT_FOUND          | `model 'X' is not served by this replica; it serves ...`     |
| empty rerank query                                | INVALID_ARGUMENT   | `query must be a non-empty string`                           |
| zero documents                                    | INVALID_ARGUMENT   | `documents must be a non-empty list of strings`              |
| more documents than --max-documents               | INVALID_ARGUMENT   | `documents has N items; this server takes at most M ...`     |
| top_n < 1                                         | INVALID_ARGUMENT   | `top_n must be >= 1, got 0`                                  |
| document too long with truncate NONE              | INVALID_ARGUMENT   | `documents[i] with the query is N tokens, over the limit ...`|
| a message that is not valid protobuf (e.g. invalid UTF-8 in a string such as chat content) | INVALID_ARGUMENT | `could not parse tandem.v1.X: string fields must be valid UTF-8 ...` (ends the whole stream: its request ids are unknown) |
| a message larger than --max-message-bytes         | RESOURCE_EXHAUSTED | grpc's own `...larger than max (N vs. M)` (ends the stream)  |
| --max-waiting requests already wait for the engine| RESOURCE_EXHAUSTED | `server is at capacity: N requests are waiting ...`          |
| the gRPC deadline passes (stream or unary)        | DEADLINE_EXCEEDED  | grpc's own `Deadline Exceeded`; the engine aborts the work   |
| a request's timeout_ms passes                     | DEADLINE_EXCEEDED  | `request exceeded its timeout_ms of N ms`                    |
| the server drains after SIGTERM                   | UNAVAILABLE        | `server is draining (shutting down); retry on another replica` |
| bearer token missing or wrong (--auth-token set)  | UNAUTHENTICATED    | `missing or invalid bearer token ...`                        |
| the engine failed a step                          | INTERNAL           | `model step failed: ...`                                     |

A client that closes its stream or channel cancels every request on it (the
engine aborts them and frees their KV blocks); so does a client-side cancel of a
unary `Rerank`.
"""
from __future__ import annotations

import grpc


class ServiceError(Exception):
    """A refusal with the status code to answer it with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"ServiceError({self.code.name}, {self.message!r})"


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def draining() -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, "server is draining (shutting down); retry on another replica")


def code_number(code: grpc.StatusCode) -> int:
    """The wire number of a status code (google.rpc.Code), as RequestError.code carries it."""
    return code.value[0]


def code_from_number(number: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return code
    return grpc.StatusCode.UNKNOWN
