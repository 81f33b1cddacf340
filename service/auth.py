"""Bearer tokens and their scopes, checked the same way by the gRPC interceptor and the HTTP door.

`token` may call every method; each scoped token only the methods it lists: names of tandem.v1.Tandem
methods such as "Rerank", or full paths "/package.Service/Method". The HTTP door names each route by the
gRPC method it maps to (service/http/app.py), so one scope covers both doors.
"""
from __future__ import annotations

import hmac
from typing import Mapping

_TANDEM_PREFIX = "/tandem.v1.Tandem/"


class TokenTable:
    def __init__(self, token: str | None, scoped: Mapping[str, tuple[str, ...] | list[str]] | None = None) -> None:
        scoped = dict(scoped or {})
        if token is not None and not token:
            raise ValueError("the auth token must not be empty")
        if not token and not scoped:
            raise ValueError("give an auth token or scoped tokens")
        if any(not t for t in scoped):
            raise ValueError("scoped auth tokens must not be empty")
        self._tokens: list[tuple[bytes, frozenset[str] | None]] = []  # (expected header, methods or None: all)
        if token:
            self._tokens.append((f"Bearer {token}".encode(), None))
        for t, methods in scoped.items():
            self._tokens.append((f"Bearer {t}".encode(), frozenset(methods)))

    def check(self, authorization: str | bytes | None, method: str) -> tuple[bool, bool]:
        """(the token in this `authorization` value is known, it may call `method`, a full gRPC path)."""
        if authorization is None:
            return False, False
        given = authorization.encode() if isinstance(authorization, str) else authorization
        short = method.rsplit("/", 1)[-1] if method.startswith(_TANDEM_PREFIX) else None
        known = allowed = False
        for expected, methods in self._tokens:  # every entry compared: no early exit on a match
            if hmac.compare_digest(given, expected):
                known = True
                allowed |= methods is None or method in methods or (short is not None and short in methods)
        return known, allowed
