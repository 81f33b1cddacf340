"""The grpc.aio server: Tandem + health + reflection, interceptors, TLS, and drain on shutdown."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.bridge import EngineBridge
from service.handlers import SERVICE_NAME, add_tandem_servicer
from service.interceptors import BearerAuthInterceptor, ReplicaInterceptor
from service.servicer import Limits, TandemServicer

log = logging.getLogger("tandem.server")


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: an ephemeral port (TandemServer.address tells which)
    max_documents: int = 1000
    max_message_bytes: int = 4 * 2**20
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight work may take before it is aborted
    stop_grace_s: float = 1.0  # after draining: how long idle streams get before they are closed
    tls_cert: str | None = None  # PEM paths; both or neither
    tls_key: str | None = None
    auth_token: str | None = None
    replica: str | None = None  # default: host:port

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and a key (--tls-cert and --tls-key)")
        if self.max_documents < 1 or self.max_message_bytes < 1024:
            raise ValueError("max_documents must be >= 1 and max_message_bytes >= 1024")


class TandemServer:
    """One listening grpc.aio server over a started EngineBridge (several servers may share one bridge)."""

    def __init__(self, bridge: EngineBridge, config: ServerConfig) -> None:
        self.bridge = bridge
        self.config = config
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.servicer: TandemServicer | None = None
        self.address = ""

    async def start(self) -> str:
        """Bind, start serving, mark health SERVING; returns host:port."""
        cfg = self.config
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", cfg.max_message_bytes),
                                          ("grpc.so_reuseport", 0)],
                                 interceptors=self._interceptors())
        bind = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert:
                creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(),
                                                      Path(cfg.tls_cert).read_bytes())])
                port = server.add_secure_port(bind, creds)
            else:
                port = server.add_insecure_port(bind)
        except RuntimeError:
            raise OSError(f"cannot listen on {bind}: is the port in use, or the host not an address of this "
                          "machine? (--host/--port, TANDEM_HOST/TANDEM_PORT)") from None
        self.address = f"{cfg.host}:{port}"
        self._replica.replica = cfg.replica or self.address
        self.servicer = TandemServicer(self.bridge, replica=self._replica.replica,
                                       limits=Limits(cfg.max_documents, cfg.max_message_bytes))
        await self.servicer.load_model_info()
        add_tandem_servicer(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server)
        await server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.server = server
        return self.address

    def _interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        self._replica = ReplicaInterceptor()  # named once the port is bound
        interceptors: list[grpc.aio.ServerInterceptor] = [self._replica]
        if self.config.auth_token:
            interceptors.append(BearerAuthInterceptor(self.config.auth_token))
        return interceptors

    async def drain(self) -> None:
        """NOT_SERVING, refuse new work, let in-flight work finish (bounded), then stop."""
        self.bridge.draining = True
        await self.health.enter_graceful_shutdown()
        try:
            await asyncio.wait_for(self.bridge.wait_idle(), self.config.drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("drain timeout (%.1fs): aborting %d requests", self.config.drain_timeout_s,
                        self.bridge.num_live)
            self.bridge.abort_all()
            try:
                await asyncio.wait_for(self.bridge.wait_idle(), 10.0)
            except asyncio.TimeoutError:
                log.error("requests still live after abort; stopping anyway")
        await self.stop()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(self.config.stop_grace_s)
            self.server = None

