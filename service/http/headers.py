"""Bounded request heads for the HTTP door: uvicorn's httptools protocol with a limit on the bytes and the number of
header fields one request may send, checked while the head arrives, before routing and auth.

httptools (llhttp) has no limit of its own, and uvicorn sets none on it (its `h11_max_incomplete_event_size` applies
to the h11 parser only): an unterminated 64 MB header line was held in full, a complete one was routed. Here a head
(request line and headers) over MAX_HEAD_BYTES, or with more than MAX_HEADER_FIELDS fields, is answered 431
(Request Header Fields Too Large, OpenAI's error shape) and the connection closed. A head still arriving is counted
per read, so what is held stays within about one read beyond the limit; a complete head is measured exactly.
Node's default is 16 KiB, nginx's 32 KiB (4 x 8k), Apache's 100 fields; 64 KiB leaves room for long tokens and
cookies on a developer's machine.
"""
from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADER_FIELDS = 100


def _response_431(message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "request_header_fields_too_large"}}).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing a request head over `max_head_bytes` or `max_fields` fields."""
    max_head_bytes = MAX_HEAD_BYTES
    max_fields = MAX_HEADER_FIELDS

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # between a message's first byte and its headers' end
        self._head_bytes = 0  # bytes read while in the head (an unterminated one grows this)
        self._fields = 0
        self._too_many = False  # more than max_fields fields so far
        self._refused = False  # answered 431; nothing more is read

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        was_in_head = self._in_head
        super().data_received(data)
        if self._refused or self.parser is None or self.transport.is_closing():
            return
        if self._too_many:
            self._refuse(f"more than {self.max_fields} request header fields")
        elif was_in_head and self._in_head:  # the head is still incomplete after this read
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse(f"request headers over {self.max_head_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._fields, self._too_many = True, 0, 0, False

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        if self._fields > self.max_fields:
            self._too_many = True  # answered at the head's end, or once the parser returns (data_received)
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if self._too_many:
            self._refuse(f"more than {self.max_fields} request header fields")
        elif size > self.max_head_bytes:
            self._refuse(f"request headers of {size} bytes, over {self.max_head_bytes}")
        else:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def _refuse(self, what: str) -> None:
        """431 and close; the request never reaches the app."""
        self._refused = True
        self.logger.warning("HTTP request refused: %s", what)
        self.transport.write(_response_431(f"{what} (the HTTP door takes at most {self.max_head_bytes} bytes and "
                                           f"{self.max_fields} fields of headers)"))
        self.transport.close()
