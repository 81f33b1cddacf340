"""Which `Host` headers the HTTP door answers: a defence against DNS rebinding, where a web page on attacker.example
re-points its own name at 127.0.0.1 and then reads the local server's answers as same-origin.

Bound to a loopback address (the default, 127.0.0.1): loopback names only (`localhost`, `*.localhost`, 127.x.x.x,
`::1`) plus `--allowed-hosts`. Bound to anything else (0.0.0.0, a LAN address, a container): every host, as
Jupyter does when it listens beyond loopback (there the network is the boundary, and clients use whatever name
reaches the machine), unless `--allowed-hosts` is given, which then lists them (loopback names stay allowed, for
health checks on the machine itself). Patterns as Starlette's TrustedHostMiddleware (and Django's ALLOWED_HOSTS)
read them: an exact name or address, `*.example.com` for its subdomains, `*` for any. A request without a Host
header (HTTP/1.0 health checks) is not a browser's and passes. A refused host gets 400, OpenAI's
`invalid_request_error` (code `invalid_host`), in the route's error shape.
"""
from __future__ import annotations

import ipaddress
import logging

LOOPBACK_HOSTS = ("localhost", "*.localhost", "127.0.0.1", "::1")

log = logging.getLogger("tandem.http")


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str, extra: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """The Host patterns the door answers when bound to `bind_host`, with `--allowed-hosts` `extra`; None: any."""
    patterns = tuple(p.strip().lower() for p in extra if p.strip())
    if "*" in patterns or (not patterns and not is_loopback(bind_host)):
        return None
    return LOOPBACK_HOSTS + patterns


def host_name(header: str) -> str:
    """The name in a Host header, without its port: `localhost:8000` -> `localhost`, `[::1]:8000` -> `::1`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    if header.count(":") == 1:
        return header.split(":", 1)[0]
    return header


def host_allowed(header: str | None, patterns: tuple[str, ...] | None) -> bool:
    if patterns is None or header is None:
        return True
    name = host_name(header)
    if not name:
        return False
    if is_loopback(name):
        return True  # every loopback address and *.localhost name (a list always holds them)
    return any(name == p or (p.startswith("*.") and name.endswith(p[1:])) for p in patterns)
