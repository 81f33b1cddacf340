"""The grpc.aio server: Tandem + health + reflection, interceptors, TLS, and drain on shutdown."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.bridge import EngineBridge
from service.handlers import SERVICE_NAME, add_tandem_servicer
from service.interceptors import BearerAuthInterceptor, ReplicaInterceptor
from service.ports import Listener, PortInUse
from service.servicer import Limits, TandemServicer
from service.session import DEFAULT_MAX_BUFFER_BYTES

log = logging.getLogger("tandem.server")


@dataclass(slots=True)
class ServerConfig:
    """What a server listens on and allows. `tandem serve` sets every field but stop_grace_s from its flags
    (service/cli.py; each flag also reads TANDEM_<FLAG>); a flag left unset keeps the default here."""
    host: str = "127.0.0.1"
    port: int = 50051  # 0: an ephemeral port (TandemServer.address tells which)
    max_documents: int = 1000
    max_message_bytes: int = 4 * 2**20
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight work may take before it is aborted
    # SIGTERM: health (gRPC and /healthz) says NOT_SERVING this long before new work is refused, so load
    # balancers stop routing first (set it to the balancer's health-check interval times its fall count).
    drain_grace_s: float = 0.0
    stop_grace_s: float = 1.0  # after draining: new work refused this long, then streams get as long to close
    tls_cert: str | None = None  # PEM paths; both or neither
    tls_key: str | None = None
    auth_token: str | None = None
    replica: str | None = None  # default: host:port
    # Responses one stream may hold unread before it fails with RESOURCE_EXHAUSTED (service/session.py).
    max_stream_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES
    tls_client_ca: str | None = None  # PEM CA bundle: mutual TLS
    # Tokens limited to some methods (e.g. a retrieval pipeline's: Rerank, RerankStream); other methods get
    # PERMISSION_DENIED. `auth_token` may call everything.
    auth_scoped_tokens: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # HTTP/2 keepalive: ping a connection idle this long, close it when the ping is not answered in time
    # (a peer that vanished without a FIN: its streams are cancelled and their KV blocks freed).
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    # Close connections idle (no open call) this long; recycle connections after this age (lets a load
    # balancer rebalance long-lived clients; in-flight calls get drain_timeout_s to finish). None: never.
    max_connection_idle_s: float | None = None
    max_connection_age_s: float | None = None
    # Concurrent calls one connection may open (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); None: grpc's default.
    max_concurrent_streams: int | None = None
    # The HTTP door (service/http/) on the same host, started by `tandem serve` (service/serve.py): None off, 0 an
    # ephemeral port (on the command line, --http-port 0 means off). It shares TLS, bearer tokens,
    # max_message_bytes (its body limit), max_documents and max_stream_buffer_bytes with gRPC.
    http_port: int | None = 8000

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and a key (--tls-cert and --tls-key)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("mutual TLS (--tls-client-ca) needs the server's own --tls-cert and --tls-key")
        if self.max_documents < 1 or self.max_message_bytes < 1024:
            raise ValueError("max_documents must be >= 1 and max_message_bytes >= 1024")
        if self.max_stream_buffer_bytes < 1024:
            raise ValueError(f"max_stream_buffer_bytes must be >= 1024, got {self.max_stream_buffer_bytes}")
        if self.drain_grace_s < 0 or self.keepalive_time_s <= 0 or self.keepalive_timeout_s <= 0:
            raise ValueError("drain_grace_s must be >= 0, keepalive_time_s and keepalive_timeout_s > 0")
        for name in ("max_connection_idle_s", "max_connection_age_s", "max_concurrent_streams"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535] or None, got {self.http_port}")
        for token, methods in self.auth_scoped_tokens.items():
            if not token or not methods:
                raise ValueError("each scoped auth token needs a non-empty token and at least one method")

    def grpc_options(self) -> list[tuple[str, int]]:
        ms = lambda seconds: int(seconds * 1000)  # noqa: E731
        options = [("grpc.max_receive_message_length", self.max_message_bytes),
                   ("grpc.so_reuseport", 0),
                   ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
                   ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
                   # clients may keep idle connections alive with pings of their own, one per 10 s at most
                   ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.http2.min_ping_interval_without_data_ms", 10_000)]
        if self.max_connection_idle_s is not None:
            options.append(("grpc.max_connection_idle_ms", ms(self.max_connection_idle_s)))
        if self.max_connection_age_s is not None:
            options += [("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
                        ("grpc.max_connection_age_grace_ms", ms(self.drain_timeout_s))]
        if self.max_concurrent_streams is not None:
            options.append(("grpc.max_concurrent_streams", self.max_concurrent_streams))
        return options


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class TandemServer:
    """One listening grpc.aio server over a started EngineBridge (several servers may share one bridge).

    `status` is the replica's one serving state: SERVING from start() until drain() or stop(), NOT_SERVING
    otherwise. The gRPC health service reports it, and so does HTTP /healthz (service/serve.py).
    """

    def __init__(self, bridge: EngineBridge, config: ServerConfig) -> None:
        self.bridge = bridge
        self.config = config
        self.health = health.aio.HealthServicer()
        self.status = NOT_SERVING
        self._grace_over = asyncio.Event()
        self._aborting = False  # abort(): a second stop signal
        self.server: grpc.aio.Server | None = None
        self.servicer: TandemServicer | None = None
        self.address = ""

    async def start(self) -> str:
        """Bind, start serving, mark health SERVING; returns host:port."""
        cfg = self.config
        server = grpc.aio.server(options=cfg.grpc_options(), interceptors=self._interceptors())
        bind = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert:
                client_ca = Path(cfg.tls_client_ca).read_bytes() if cfg.tls_client_ca else None
                creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(),
                                                      Path(cfg.tls_cert).read_bytes())],
                                                    root_certificates=client_ca,
                                                    require_client_auth=client_ca is not None)
                port = server.add_secure_port(bind, creds)
            else:
                port = server.add_insecure_port(bind)
        except RuntimeError:
            raise PortInUse(Listener("gRPC", cfg.port, "--port").problem(cfg.host, "grpc could not bind it")) \
                from None
        self.address = f"{cfg.host}:{port}"
        self._replica.replica = cfg.replica or self.address
        self.servicer = TandemServicer(self.bridge, replica=self._replica.replica,
                                       limits=Limits(max_documents=cfg.max_documents,
                                                     max_message_bytes=cfg.max_message_bytes,
                                                     max_stream_buffer_bytes=cfg.max_stream_buffer_bytes))
        await self.servicer.load_model_info()
        add_tandem_servicer(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server)
        await server.start()
        self.server = server
        await self._set_status(SERVING)
        return self.address

    @property
    def serving(self) -> bool:
        """True while health reports SERVING (safe to read from any thread, e.g. the /healthz one)."""
        return self.status == SERVING

    async def _set_status(self, status: int) -> None:
        self.status = status
        if status == SERVING:
            for name in ("", SERVICE_NAME):
                await self.health.set(name, status)
        else:  # for good: the health servicer ignores later changes
            await self.health.enter_graceful_shutdown()

    def _interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        self._replica = ReplicaInterceptor()  # named once the port is bound
        interceptors: list[grpc.aio.ServerInterceptor] = [self._replica]
        if self.config.auth_token or self.config.auth_scoped_tokens:
            interceptors.append(BearerAuthInterceptor(self.config.auth_token, self.config.auth_scoped_tokens))
        return interceptors

    async def drain(self) -> None:
        """NOT_SERVING at once; new work still served for drain_grace_s (end_grace() cuts it short) so load
        balancers stop routing here first; then refuse new work, let in-flight work finish (bounded), stop.
        abort() at any point ends it as soon as the engine has stopped what runs."""
        await self._set_status(NOT_SERVING)
        grace = self.config.drain_grace_s
        if grace > 0:
            log.info("NOT_SERVING; still taking new work for %.1fs (--drain-grace) while load balancers notice",
                     grace)
            try:
                await asyncio.wait_for(self._grace_over.wait(), grace)
            except asyncio.TimeoutError:
                pass
        log.info("draining (up to %.0fs)", self.config.drain_timeout_s)
        self.bridge.draining = True
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
        # A request arriving after the last in-flight one finished but before the transport closes would be
        # cancelled by grpc (CANCELLED, which clients do not retry); a moment of refusing with UNAVAILABLE first
        # tells a client that is still sending to go elsewhere. Not after abort(): it was asked to stop now.
        if not self._aborting:
            await asyncio.sleep(self.config.stop_grace_s)
        await self.stop()

    def end_grace(self) -> None:
        """Refuse new work now rather than at the end of drain_grace_s."""
        self._grace_over.set()

    def abort(self) -> None:
        """Stop now (a second SIGTERM or Ctrl-C): end the grace, refuse new work, abort every in-flight request;
        a drain() under way returns once the engine has stopped them, without the stop grace."""
        self._aborting = True
        self.end_grace()
        self.bridge.draining = True
        self.bridge.abort_all()

    async def stop(self) -> None:
        await self._set_status(NOT_SERVING)
        if self.server is not None:
            await self.server.stop(0 if self._aborting else self.config.stop_grace_s)
            self.server = None

