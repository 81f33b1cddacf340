"""The grpc.aio server: Tandem + health + reflection, interceptors, TLS, and drain on shutdown."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.config import ServerConfig
from service.core import CoreAPI
from service.handlers import SERVICE_NAME, add_tandem_servicer
from service.interceptors import BearerAuthInterceptor, ReplicaInterceptor
from service.ports import Listener, PortInUse
from service.servicer import TandemServicer

log = logging.getLogger("tandem.server")


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Once the drain timeout has cut in-flight work, the most the gRPC door's stop may take after it (the aborts reaching
# the engine, the last messages to their streams, the transport closing, a third each); docs/reliability.md.
CUT_MARGIN_S = 1.5


class TandemServer:
    """One listening grpc.aio server over the core API (several servers may share one core and its bridge).

    `status` is the replica's one serving state: SERVING from start() until drain() or stop(), NOT_SERVING
    otherwise. The gRPC health service reports it, and so does HTTP /healthz (service/serve.py).
    """

    def __init__(self, core: CoreAPI, config: ServerConfig) -> None:
        self.core = core
        self.config = config
        self.health = health.aio.HealthServicer()
        self.status = NOT_SERVING
        self._grace_over = asyncio.Event()
        self._aborting = False  # abort(): a second stop signal
        self._cut = False  # the drain timeout aborted in-flight work: what is left of the stop is bounded
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
        self.servicer = TandemServicer(self.core, replica=self._replica.replica)
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
        self.core.drain()
        try:
            await asyncio.wait_for(self.core.wait_idle(), self.config.drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("drain timeout (%.1fs): aborting %d requests", self.config.drain_timeout_s,
                        self.core.num_live)
            self._cut = True
            self.core.abort_all()
            await self._settle_aborts()
        await self._deliver_last_messages()
        # A request arriving after the last in-flight one finished but before the transport closes would be
        # cancelled by grpc (CANCELLED, which clients do not retry); a moment of refusing with UNAVAILABLE first
        # tells a client that is still sending to go elsewhere. Not after abort(), nor once the drain timeout has
        # cut work: the drain's time is spent, and new work has been refused all along it.
        if not self._aborting and not self._cut:
            await asyncio.sleep(self.config.stop_grace_s)
        await self.stop()

    def _after_cut_s(self, usual_s: float) -> float:
        """How long a step of the stop may take: `usual_s`, or its part of CUT_MARGIN_S once the drain timeout has
        cut work (the aborts reaching the engine, the last messages, the transports closing: one third each), so
        the process ends within CUT_MARGIN_S of the drain timeout (docs/reliability.md)."""
        return CUT_MARGIN_S / 3 if self._cut else usual_s

    async def _settle_aborts(self) -> None:
        """Wait for the engine to end the aborted requests (one step); bridge.stop() fails any it has not."""
        try:
            await asyncio.wait_for(self.core.wait_idle(), self._after_cut_s(10.0))
        except asyncio.TimeoutError:
            log.error("requests still live after abort; stopping anyway")

    async def _deliver_last_messages(self) -> None:
        """The engine has ended every request; its last message may still be on its way to the client's stream."""
        if self.servicer is None:
            return
        try:
            await asyncio.wait_for(self.servicer.delivered(), self._after_cut_s(10.0))
        except asyncio.TimeoutError:  # a client that stopped reading: its stream is cancelled below
            log.warning("some streams did not take their last messages; stopping anyway")

    def end_grace(self) -> None:
        """Refuse new work now rather than at the end of drain_grace_s."""
        self._grace_over.set()

    def abort(self) -> None:
        """Stop now (a second SIGTERM or Ctrl-C): end the grace, refuse new work, abort every in-flight request;
        a drain() under way returns once the engine has stopped them, without the stop grace."""
        self._aborting = True
        self.end_grace()
        self.core.drain()
        self.core.abort_all()

    async def stop(self) -> None:
        await self._set_status(NOT_SERVING)
        if self.server is not None:
            await self.server.stop(0 if self._aborting else self._after_cut_s(self.config.stop_grace_s))
            self.server = None

