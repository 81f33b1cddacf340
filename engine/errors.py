"""Errors the engine's intake raises beyond a plain ValueError (bad input)."""
from __future__ import annotations


class InputTooLong(ValueError):
    """An input over a length limit that its request asked not to cut (truncation off). The message says what is too
    long and ends "shorten it"; how to ask for the cut instead is for the caller to add, in its own API's spelling
    (TEI's `truncate: true`, gRPC's TRUNCATE_END, Cohere's `truncate: "END"`)."""


class NotLoaded(ValueError):
    """A request for something this engine has not loaded (an embedding with no embedder): the input may be fine,
    the engine cannot serve it (the service answers FAILED_PRECONDITION)."""
