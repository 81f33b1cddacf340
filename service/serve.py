"""`tandem serve`: load the engine, start the bridge and the server, drain on SIGTERM/SIGINT, exit 0."""
from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from service.bridge import EngineBridge
from service.core import CoreAPI
from service.lifecycle import LifecycleHooks
from service.metrics import Metrics
from service.server import ServerConfig, TandemServer
from service.tracing import TracingHooks, describe_tracing, tracer_provider_from_env

log = logging.getLogger("tandem.serve")


async def serve(engine_config, server_config: ServerConfig, *, max_waiting: int,
                ready: Callable[[str], None] = print, hooks: tuple[LifecycleHooks, ...] = (),
                metrics_port: int | None = None) -> int:
    """Serve until SIGTERM or SIGINT; the first drains, a second one aborts what is still running.

    On the first signal the replica reports NOT_SERVING at once (gRPC health and HTTP /healthz, both from
    `TandemServer.status`), keeps taking new work for `server_config.drain_grace_s` so a load balancer polling
    its health check can stop routing to it, then drains: new work gets UNAVAILABLE, in-flight work finishes
    (up to the drain timeout). See TandemServer.drain.
    """
    from engine import LLMEngine  # torch only here, so client commands stay light

    try:
        engine = await _in_own_thread(LLMEngine, engine_config)
    except Exception as exc:  # noqa: BLE001 (said in one line by the CLI; the traceback at --log-level debug)
        raise StartupError(exc) from exc
    metrics = Metrics()
    provider = tracer_provider_from_env()  # None unless an OTLP endpoint is configured
    log.info("%s", describe_tracing(provider))
    tracing = TracingHooks(provider) if provider is not None else None
    hooks = (*hooks, metrics) + ((tracing,) if tracing else ())
    bridge = EngineBridge(engine, max_waiting=max_waiting, hooks=hooks)
    bridge.start()
    core = await CoreAPI.load(bridge, server_config.limits(), server_config.names())
    server = TandemServer(core, server_config)
    http = _serve_metrics(metrics, server_config.host, metrics_port, lambda: server.serving)
    try:
        address = await server.start()
    except OSError as exc:
        log.error("%s", exc)
        await bridge.stop()
        await _stop_telemetry(http, tracing)
        return 1
    door = await _serve_http(core, server_config, server, metrics)
    ready(address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            log.warning("second %s: aborting %d in-flight requests and stopping now", name, bridge.num_live)
            bridge.abort_all()
            server.end_grace()  # a second signal cuts the grace short
        else:
            log.warning("%s: stopping; in-flight requests get up to %.0fs to finish (--drain-timeout). "
                        "Press Ctrl-C again (or send %s again) to abort them and stop now",
                        name, server_config.drain_timeout_s, name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await stop.wait()
    await server.drain()  # both doors: the bridge refuses new work, in-flight work of either door finishes
    if door is not None:
        await door.stop()
    await bridge.stop()
    await _stop_telemetry(http, tracing)
    return 0


async def _in_own_thread(fn: Callable, *args):
    """fn(*args) on a thread that ends when fn returns. Loading runs torch's OpenMP regions, and libgomp keeps a
    pool of workers for every thread that starts one, until that thread exits: a loader thread of asyncio's
    executor would keep its idle pool for the process's life beside the engine thread's, so OpenMP would count
    more threads than cores and cut every wait to its throttled spin count (none under PASSIVE), making each
    parallel region of a decode step wake a sleeping worker. Leaving the `with` joins the finished thread."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-load") as pool:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


class StartupError(Exception):
    """The engine could not be built (bad path, unsupported model, no CUDA...): the CLI says it in one line."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


async def _serve_http(core: CoreAPI, config: ServerConfig, server: TandemServer, metrics: Metrics):
    """Start the HTTP door on the same loop and bridge; a busy port costs the HTTP door, never gRPC."""
    if config.http_port is None:
        return None
    from service.http.server import HttpServer  # starlette and uvicorn only when HTTP is on

    door = HttpServer(core, config, config.http_port, serving=lambda: server.serving, registry=metrics.registry)
    try:
        await door.start()
    except OSError as exc:
        log.warning("HTTP door not served: %s", exc)
        return None
    log.info("HTTP (OpenAI /v1/chat/completions, /v1/completions; rerank /v1/rerank, /v2/rerank, /rerank; "
             "embeddings %s; /metrics, /health, /ready) on %s",
             f"/v1/embeddings, /v2/embed, /embed with {core.info.embedder}" if core.info.embedder
             else "off", door.url)
    return door


def _serve_metrics(metrics: Metrics, host: str, port: int | None, healthy: Callable[[], bool]):
    """Start the /metrics and /healthz endpoint; a busy port costs the metrics, never the service."""
    if port is None or port < 0:
        log.info("Prometheus metrics off (--metrics-port -1)")
        return None
    try:
        http, _ = metrics.serve(host, port, healthy)
    except OSError as exc:
        log.warning("Prometheus metrics not served on %s:%s: %s", host, port, exc)
        return None
    log.info("Prometheus metrics on http://%s:%d/metrics, health on /healthz", host, http.server_address[1])
    return http


async def _stop_telemetry(http, tracing: TracingHooks | None) -> None:
    if http is not None:
        http.shutdown()
    if tracing is not None:
        await asyncio.to_thread(tracing.shutdown)  # bounded flush: a dead collector cannot hold up exit
