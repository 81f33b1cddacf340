"""The ports `tandem serve` listens on, checked before the model loads: a port that cannot be bound stops the
server with one line naming the port and the flag that moves it (never a warning and a server without that door).

Only a fixed port is checked here; port 0 (any free port) cannot clash, and a door that is off is not listened on.
The doors' own binds fail with the same kind of line should a port be taken between this check and them.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass


class PortInUse(OSError):
    """A port `tandem serve` was asked to listen on cannot be bound; the message is the line the CLI prints."""


@dataclass(frozen=True, slots=True)
class Listener:
    what: str  # "gRPC", "HTTP", "Prometheus metrics"
    port: int
    flag: str  # the flag that moves it, e.g. "--http-port"
    off: str | None = None  # how to turn it off, e.g. "--http-port off"; None: it cannot be

    def problem(self, host: str, reason: str) -> str:
        off = f"; {self.off} turns it off" if self.off else ""
        variable = "TANDEM_" + self.flag.lstrip("-").replace("-", "_").upper()
        return (f"cannot listen for {self.what} on {host}:{self.port} ({reason}): another process holds the port, "
                f"or {host} is not an address of this machine; move it with {self.flag} (or {variable}){off}")


def check_free(host: str, listeners: list[Listener]) -> None:
    """Raise PortInUse for the first fixed port of `listeners` that cannot be bound on host now."""
    for listener in listeners:
        if listener.port <= 0:
            continue
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, listener.port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the doors bind: TIME_WAIT is fine
                sock.bind(address)
        except OSError as exc:
            raise PortInUse(listener.problem(host, exc.strerror or str(exc))) from None
