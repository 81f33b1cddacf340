"""The HTTP door's server: uvicorn serving service/http/app.py on the running event loop (the gRPC server's
uvloop), over the same core API, with the gRPC door's TLS files and bearer tokens."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
from typing import Callable

import uvicorn
from prometheus_client import CollectorRegistry

from service.auth import TokenTable
from service.config import ServerConfig
from service.core import CoreAPI
from service.http.app import Door, build_app
from service.http.headers import BoundedHeadProtocol
from service.http.hosts import allowed_hosts

log = logging.getLogger("tandem.http")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: `tandem serve` handles SIGTERM/SIGINT for both doors."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    def __init__(self, core: CoreAPI, config: ServerConfig, port: int, *,
                 serving: Callable[[], bool] = lambda: True, registry: CollectorRegistry | None = None) -> None:
        self.core = core
        self.config = config
        self.port = port  # 0: an ephemeral port
        self.serving = serving
        self.registry = registry
        self.address = ""
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return ("https" if self.config.tls_cert else "http") + "://" + self.address

    async def start(self) -> str:
        """Bind (OSError if the port is taken), then serve from a task on this loop; returns host:port."""
        cfg = self.config
        sock = _bind(cfg.host, self.port)
        host, port = sock.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        table = TokenTable(cfg.auth_token, cfg.auth_scoped_tokens) if (cfg.auth_token or cfg.auth_scoped_tokens) \
            else None
        door = Door(core=self.core, max_body_bytes=cfg.max_message_bytes, tokens_table=table, serving=self.serving,
                    registry=self.registry, replica=cfg.replica or self.address,
                    allowed_hosts=allowed_hosts(cfg.host, cfg.allowed_hosts))
        # httptools, with the request head bounded (service/http/headers.py: uvicorn sets no limit on that parser)
        uv = uvicorn.Config(build_app(door), lifespan="off", access_log=False, log_level="warning",
                            http=BoundedHeadProtocol, ws="none", timeout_keep_alive=30,
                            timeout_graceful_shutdown=max(1, math.ceil(cfg.stop_grace_s)),
                            ssl_certfile=cfg.tls_cert, ssl_keyfile=cfg.tls_key, ssl_ca_certs=cfg.tls_client_ca,
                            ssl_cert_reqs=ssl.CERT_REQUIRED if cfg.tls_client_ca else ssl.CERT_NONE)
        self._server = _Server(uv)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="tandem-http")
        return self.address

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        await self._task
        self._server = self._task = None


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # connections made before uvicorn starts accepting wait in the backlog
    except OSError as exc:
        raise OSError(f"cannot listen for HTTP on {host}:{port} ({exc.strerror or exc}): is the port in use? "
                      "(--http-port, TANDEM_HTTP_PORT; 0 turns HTTP off)") from None
    sock.set_inheritable(False)
    return sock
