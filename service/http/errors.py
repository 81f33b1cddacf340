"""HTTP statuses for the service's status codes, and each API's own error body.

| ErrorKind (service/errors.py) | HTTP | OpenAI `error.type`      |
|-------------------------------|------|--------------------------|
| INVALID_ARGUMENT              | 400  | invalid_request_error    |
| UNAUTHENTICATED               | 401  | authentication_error     |
| PERMISSION_DENIED             | 403  | permission_error         |
| NOT_FOUND (model, path)       | 404  | invalid_request_error (code model_not_found) / not_found_error |
| (body over the size limit)    | 413  | invalid_request_error (code request_too_large) |
| (a body that is not JSON)     | 415  | invalid_request_error (code unsupported_media_type) |
| (headers over the limit)      | 431  | invalid_request_error (service/http/headers.py) |
| RESOURCE_EXHAUSTED            | 429  | rate_limit_error (code rate_limit_exceeded) |
| DEADLINE_EXCEEDED             | 504  | timeout_error            |
| UNAVAILABLE (draining)        | 503  | service_unavailable      |
| INTERNAL and anything else    | 500  | server_error             |

Bodies: OpenAI `{"error": {"message", "type", "param", "code"}}`; Cohere `{"message"}` (Jina clients read it
too); TEI `{"error", "error_type"}`. Never a stack trace: an unexpected exception becomes a 500 with its type name.
"""
from __future__ import annotations

import enum
import json

from service.errors import ErrorKind, ServiceError

S = ErrorKind
_STATUS = {S.INVALID_ARGUMENT: 400, S.UNAUTHENTICATED: 401, S.PERMISSION_DENIED: 403, S.NOT_FOUND: 404,
           S.ALREADY_EXISTS: 409, S.RESOURCE_EXHAUSTED: 429, S.DEADLINE_EXCEEDED: 504, S.UNAVAILABLE: 503,
           S.CANCELLED: 499, S.FAILED_PRECONDITION: 400}
_OPENAI_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
                431: "invalid_request_error", 499: "invalid_request_error",
                503: "service_unavailable", 504: "timeout_error"}
_TEI_TYPE = {400: "Validation", 401: "Unauthorized", 403: "Unauthorized", 404: "NotFound", 413: "Validation",
             415: "Validation",
             429: "Overloaded", 503: "Unhealthy", 504: "Overloaded"}


class Shape(enum.Enum):
    """Whose error body a route answers with."""
    OPENAI = "openai"
    COHERE = "cohere"
    TEI = "tei"


class HttpError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 from_core: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.from_core = from_core  # a ServiceError of the core API's (its lifecycle hooks heard of it already)

    @classmethod
    def from_service(cls, error: ServiceError) -> "HttpError":
        status = _STATUS.get(error.kind, 500)
        code = "model_not_found" if error.kind is S.NOT_FOUND and error.message.startswith("model ") else None
        if error.kind is S.RESOURCE_EXHAUSTED:
            code = "rate_limit_exceeded"
        return cls(status, error.message, code=code, from_core=True)

    def body(self, shape: Shape) -> dict:
        if shape is Shape.COHERE:
            return {"message": self.message}
        if shape is Shape.TEI:
            return {"error": self.message, "error_type": _TEI_TYPE.get(self.status, "Backend")}
        kind = _OPENAI_TYPE.get(self.status, "server_error")
        if self.status == 404 and self.code == "model_not_found":
            kind = "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def sse(self) -> bytes:
        """The error as a server-sent event, for a stream whose 200 was already sent."""
        return b"data: " + json.dumps(self.body(Shape.OPENAI)).encode() + b"\n\n"
