"""Status codes the service answers with, and the error type that carries one.

Every refusal is a gRPC status code plus a message a person can act on. On a
`Generate` or `RerankStream` stream, a refusal of one request arrives as a
`RequestError` for its request id (same code and message) and the stream goes
on; on `Rerank` and `ModelInfo` it is the call's status. Rows marked *stream*
end the whole stream instead (the request id cannot be known, or grpc itself
refuses). Tests: tests/service/test_errors.py walks this table.

| Situation                                              | Code               | Message (start)                                                  |
|--------------------------------------------------------|--------------------|------------------------------------------------------------------|
| cancel for an id with no live request on the stream    | NOT_FOUND          | `cancel: no live request 'ID' on this stream`                    |
| request id already live on the same stream             | ALREADY_EXISTS     | `request_id 'ID' is already live on this stream` (the first goes on) |
| empty request_id (Generate, RerankStream)              | INVALID_ARGUMENT   | `request_id must be a non-empty string`                          |
| client message with neither request nor cancel         | INVALID_ARGUMENT   | `empty client message: set request or cancel`                    |
| no prompt, messages or token_ids                       | INVALID_ARGUMENT   | `request has no input: set prompt, messages or token_ids`        |
| empty prompt / empty token_ids                         | INVALID_ARGUMENT   | `prompt must not be empty`                                       |
| prompt too long for the context or the KV cache        | INVALID_ARGUMENT   | `prompt has N tokens; max_model_len is M ...`                    |
| token id outside the vocabulary                        | INVALID_ARGUMENT   | `prompt token ids must be integers in [0, V)`                    |
| chat message with an empty role                        | INVALID_ARGUMENT   | `messages[i].role must not be empty ...`                         |
| no chat messages                                       | INVALID_ARGUMENT   | `messages must be a non-empty list of {role, content}`           |
| max_tokens < 1                                         | INVALID_ARGUMENT   | `max_tokens must be an integer >= 1, got -1`                     |
| prompt plus max_tokens over the context (never clamped) | INVALID_ARGUMENT  | `max_tokens is too large: N; the prompt has P tokens and max_model_len is M, so max_tokens can be at most M-P` |
| temperature NaN, infinite or < 0                       | INVALID_ARGUMENT   | `temperature must be a finite number >= 0, got nan`              |
| top_p outside (0, 1] / top_k < -1                      | INVALID_ARGUMENT   | `top_p must be in (0, 1] ...` / `top_k must be ...`              |
| n = 0 or over 16                                       | INVALID_ARGUMENT   | `n must be an integer in [1, 16], got 0`                         |
| logprobs / prompt_logprobs over 20                     | INVALID_ARGUMENT   | `logprobs must be an integer in [0, 20] or None, got 21`         |
| repetition_penalty <= 0, NaN or infinite               | INVALID_ARGUMENT   | `repetition_penalty must be a finite number > 0, got nan`        |
| presence / frequency_penalty outside [-2, 2] or NaN    | INVALID_ARGUMENT   | `presence_penalty must be a number in [-2, 2], got nan`          |
| min_p outside [0, 1] or NaN                            | INVALID_ARGUMENT   | `min_p must be in [0, 1], got 1.5`                               |
| min_tokens over max_tokens                             | INVALID_ARGUMENT   | `min_tokens must be an integer in [0, max_tokens=M], got N`      |
| logit_bias id < 0 / >= the vocabulary, bias outside [-100, 100] | INVALID_ARGUMENT | `logit_bias keys must be token ids ...` / `logit_bias token ids must be in [0, V)` / `logit_bias values must be ...` |
| response_format.json_schema not JSON / not an object   | INVALID_ARGUMENT   | `response_format.json_schema is not valid JSON: ...`             |
| a schema or regex the grammar library cannot compile, an empty choice | INVALID_ARGUMENT | `structured_outputs.json is not a usable JSON schema: ...` / `structured_outputs.regex is not a usable regular expression: ...` / `structured_outputs.choice must be ...` (at submission, never a failed step) |
| model names something this replica does not serve (a rerank: only with --strict-model-names; else the one reranker scores it) | NOT_FOUND | `model 'X' is not served by this replica; it serves [...]` |
| chat message whose role is not system, user, assistant, tool or developer | INVALID_ARGUMENT | `messages[i].role must be one of system, user, assistant, tool, developer; got 'X'` |
| Embed on a server without an embedding model (`--embedder none`) | FAILED_PRECONDITION | `this server has no embedding model ...` |
| empty rerank query                                     | INVALID_ARGUMENT   | `query must be a non-empty string`                               |
| zero documents                                         | INVALID_ARGUMENT   | `documents must be a non-empty list of strings`                  |
| more documents than --max-documents                    | INVALID_ARGUMENT   | `documents has N items; this server takes at most M per request` |
| more embedding inputs than --max-embed-inputs          | INVALID_ARGUMENT   | `input has N items; this server takes at most M per request` |
| top_n < 1                                              | INVALID_ARGUMENT   | `top_n must be >= 1, got 0`                                      |
| document too long with truncate NONE                   | INVALID_ARGUMENT   | `documents[i] with the query is N tokens, over the rerank pair limit of M ...; shorten it or set truncate to TRUNCATE_END` (HTTP: each API's own spelling, e.g. TEI's `truncate: true`) |
| bytes that are not a valid message, e.g. invalid UTF-8 in chat content (*stream*) | INVALID_ARGUMENT | `could not parse tandem.v1.X: string fields must be valid UTF-8 ...` |
| a message over --max-message-bytes (*stream*)          | RESOURCE_EXHAUSTED | grpc's own `... larger than max (N vs. M)`                       |
| --max-waiting requests already wait for the engine     | RESOURCE_EXHAUSTED | `server is at capacity: N requests are waiting for the engine ...` |
| a client stopped reading: over --max-stream-buffer-bytes of responses queued (*stream*) | RESOURCE_EXHAUSTED | `stream buffer full: the client did not read N queued responses ...`; its requests are cancelled |
| the call's gRPC deadline passes (*stream*)             | DEADLINE_EXCEEDED  | grpc's own `Deadline Exceeded`; the engine aborts the work       |
| a request's timeout_ms passes                          | DEADLINE_EXCEEDED  | `request exceeded its timeout_ms of N ms`                        |
| new work while the server drains after SIGTERM         | UNAVAILABLE        | `server is draining (shutting down); retry on another replica`   |
| a rerank still running when the drain timeout ends     | UNAVAILABLE        | `rerank aborted: the server is shutting down; retry`             |
| bearer token missing or wrong (--auth-token set)       | UNAUTHENTICATED    | `missing or invalid bearer token: send metadata 'authorization: Bearer <token>'` |
| a scoped bearer token calls a method outside its scope | PERMISSION_DENIED  | `this bearer token may not call /tandem.v1.Tandem/X; ...`        |
| mutual TLS: no client certificate, or one the CA did not sign | (no status: the TLS handshake fails; clients see UNAVAILABLE) |        |
| the engine failed a step                               | INTERNAL           | `model step failed: ...` (only that step's requests; the next step serves) |

Not errors: a cancelled generation ends with a final message whose finish
reason is ABORT (so does one still running when the drain timeout ends). A
client that closes its stream or channel cancels every request on it, and a
client-side cancel of a unary `Rerank` aborts its job: the engine stops the work
and frees its KV blocks either way. While draining, new streams are still
accepted and each request on them gets UNAVAILABLE; health reports NOT_SERVING.
"""
from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """What kind of refusal, door-neutral: the core API and the bridge say this and nothing grpc- or HTTP-shaped.
    The gRPC door answers with the status code of the same name, the HTTP door with its status
    (service/http/errors.py). The values are google.rpc.Code numbers, what a `tandem.v1.RequestError` carries."""
    CANCELLED = 1
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16

    @classmethod
    def named(cls, name: str) -> "ErrorKind":
        """The kind of a status name (an access-log field): INTERNAL for a name no refusal of ours carries."""
        return cls.__members__.get(name, cls.INTERNAL)


class ServiceError(Exception):
    """A refusal with the kind to answer it with."""

    def __init__(self, kind: ErrorKind, message: str, *, too_long: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        # An input over a limit that its request asked not to cut: the core API adds how to ask for the cut, in
        # the spelling of the API the request came through.
        self.too_long = too_long

    def __repr__(self) -> str:
        return f"ServiceError({self.kind.name}, {self.message!r})"


def invalid(message: str) -> ServiceError:
    return ServiceError(ErrorKind.INVALID_ARGUMENT, message)


def draining() -> ServiceError:
    return ServiceError(ErrorKind.UNAVAILABLE, "server is draining (shutting down); retry on another replica")

