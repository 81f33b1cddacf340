"""What the HTTP door needs of one route of a kind served by an encoder of its own (service/kinds.py pooled()): the
kind's door schema module (its `http_schema`) maps each of the kind's routes to one `KindRoute`, and
service/http/app.py serves every such route with one handler (the body parsed, CoreAPI.pool, the outcome answered
in the route's shape)."""
from __future__ import annotations

import importlib
from typing import Any, Callable, NamedTuple

from service.http.errors import Shape
from service.kinds import Kind


class KindRoute(NamedTuple):
    body: type  # the pydantic model its body parses into (its `to_input()`: the core's EmbedInput)
    respond: Callable[[Any, Any], Any]  # (the core's PooledOutcome, the parsed body) -> the JSON answered
    shape: Shape  # its API's error shape


def kind_routes(kind: Kind) -> dict[str, KindRoute]:
    """Each of `kind`'s HTTP routes (Kind.routes) with its KindRoute from the kind's door schema module (its
    `ROUTES`); RuntimeError where the two disagree."""
    table: dict[str, KindRoute] = importlib.import_module(kind.http_schema).ROUTES
    missing = [path for path in kind.routes if path not in table]
    if missing:
        raise RuntimeError(f"{kind.http_schema}.ROUTES has no entry for {kind.task.value}'s routes {missing}")
    return {path: table[path] for path in kind.routes}
