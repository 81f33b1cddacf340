"""A schema a request gives as JSON text (gRPC's json_schema, HTTP's guided_json string), parsed once for both doors."""
from __future__ import annotations

import json


def json_schema(text: str, where: str) -> dict:
    """A schema given as JSON text (gRPC's json_schema, HTTP's guided_json string): it must parse and be an
    object. Raises ValueError naming `where`."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; deep nesting recurses
        message = str(exc)
        raise ValueError(f"{where} is not valid JSON: {message[:200] + '...' if len(message) > 200 else message}"
                         ) from None
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON object (a schema), got {type(schema).__name__}")
    return schema
