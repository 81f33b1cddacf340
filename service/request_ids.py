"""The one id of a request: minted by the core API for every request it admits, used by the engine, its step records,
the spans, the lifecycle hooks and the HTTP responses (`chatcmpl-<id>`, a rerank's or embedding's `id`)."""
from __future__ import annotations

import itertools
import uuid

from service.kinds import Kind

_PROCESS_TAG = uuid.uuid4().hex[:8]  # ids of different processes (restarts, replicas) differ
_REQUEST_NUMBERS = itertools.count()


def new_request_id(kind: Kind) -> str:
    """The one id of a request, unique in the process: its kind's letter, a number, this process's tag
    (`g12-3fa9c2d1`)."""
    return f"{kind.letter}{next(_REQUEST_NUMBERS)}-{_PROCESS_TAG}"
