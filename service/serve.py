"""`tandem serve`: check the ports, load the engine, start the bridge and the doors, drain on SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
from typing import Callable

from service import ports
from service.access_log import AccessLog
from service.bridge import EngineBridge, settle
from service.core import CoreAPI, short_name
from service.http.hosts import allowed_hosts
from service.lifecycle import LifecycleHooks
from service.metrics import Metrics
from service.phases import phase, weights_size
from service.server import ServerConfig, TandemServer
from service.shutdown import ShutdownTally
from service.step_log import StepLog
from service.tool_calls import describe_tools
from service.tool_calls import support as tool_support
from service.tracing import TracingHooks, describe_tracing, tracer_provider_from_env
from service.vllm_metrics import VllmMetrics

log = logging.getLogger("tandem.serve")


async def _calibrate(engine):
    """The latency objective's step-time model fitted to this machine before the first request (engine/calibrate.py;
    seconds the first time, cached after); None when the objective is off."""
    from engine.calibrate import calibrate
    from engine.settings import Settings

    if getattr(engine.admission, "model", None) is None:
        return None
    with phase(log, "calibrating the step-time model of the latency objective"):
        settings = Settings.from_env()
        return await _in_own_thread(lambda: calibrate(engine, settings.cache_dir, force=settings.recalibrate))


async def serve(engine_config, server_config: ServerConfig, *, max_waiting: int,
                ready: Callable[[str], None] = print, hooks: tuple[LifecycleHooks, ...] = (),
                metrics_port: int | None = None, access_log: bool = True, step_log: str | None = None) -> int:
    """Serve until SIGTERM or SIGINT; the first drains, a second one aborts what is still running and stops now.

    Every port is checked before the model loads, and a port that cannot be bound (gRPC, HTTP, metrics) raises
    StartupError with a line naming it and its flag. On the first signal the replica reports NOT_SERVING at once
    (gRPC health and HTTP /ready, /healthz, all from `TandemServer.status`), keeps taking new work for
    `server_config.drain_grace_s` so a load balancer polling its health check can stop routing to it, then drains:
    new work gets UNAVAILABLE, in-flight work finishes (up to the drain timeout). See TandemServer.drain. The last
    log line says how it ended: the signal, the requests drained and aborted.
    """
    from engine import LLMEngine  # torch only here, so client commands stay light

    try:
        # Where spans go (OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_*): a bad setting fails before the model loads.
        provider = tracer_provider_from_env()
        ports.check_free(server_config.host, _listeners(server_config, metrics_port))
        with phase(log, f"loading the model ({engine_config.model or 'embedded SmolLM2-135M-Instruct'})",
                   weights_size(engine_config.model)):
            engine = await _in_own_thread(LLMEngine, engine_config)
        tools = tool_support(server_config.tool_settings(), engine.tokenizer.chat_template,
                             engine.hf_config.get("model_type"), engine.tokenizer)
        calibration = await _calibrate(engine)
    except Exception as exc:  # noqa: BLE001 (said in one line by the CLI; the traceback at --log-level debug)
        raise StartupError(exc) from exc
    if calibration is not None:
        log.info("%s", calibration.summary())
    log.info("%s", describe_tools(tools))
    # The name requests and responses use (service/core.py): the first --served-model-name, else the short id.
    model_name = (server_config.served_model_names or (short_name(str(engine.model_info()["model"])),))[0]
    metrics = Metrics()
    log.info("%s", describe_tracing(provider))
    tracing = TracingHooks(provider) if provider is not None else None
    tally = ShutdownTally()
    steps = StepLog(step_log) if step_log else None
    hooks = (*hooks, metrics, VllmMetrics(metrics.registry, model_name), tally,
             *((AccessLog(model_name),) if access_log else ()), *((tracing,) if tracing else ()),
             *((steps,) if steps else ()))
    if not access_log:
        log.info("access log off (--no-access-log)")
    bridge = EngineBridge(engine, max_waiting=max_waiting, hooks=hooks)
    bridge.start()
    core = await CoreAPI.load(bridge, server_config.limits(), server_config.names(), tools)
    server = TandemServer(core, server_config)
    http = door = None
    try:
        http = _serve_metrics(metrics, server_config.host, metrics_port, lambda: server.serving,
                              allowed_hosts(server_config.host, server_config.allowed_hosts))
        # The HTTP door first: gRPC's start turns health SERVING, and a balancer that sees it may send HTTP at once.
        door = await _serve_http(core, server_config, server, metrics)
        address = await server.start()
    except OSError as exc:
        if door is not None:
            await door.stop()
        await server.stop()
        await bridge.stop()
        await _stop_metrics(http)
        await _stop_tracing(tracing)
        raise StartupError(exc) from exc
    _freeze_startup_objects()
    # The stop signals are handled before the replica says it is ready: a SIGTERM sent the moment it does (a test,
    # an orchestrator that saw the line) drains it, where before the handlers were in place it killed the process.
    signals = _StopSignals(server, tally)
    ready(address)
    await signals.wait()
    await server.drain()  # both doors: the bridge refuses new work, in-flight work of either door finishes
    await asyncio.gather(*((door.stop(),) if door is not None else ()), _stop_metrics(http))
    await bridge.stop()
    await _stop_tracing(tracing)
    if steps is not None:
        steps.close()
    log.info("%s", tally.summary(signals.how))
    return 0


def _freeze_startup_objects() -> None:
    """Moves every object alive once the server is up (the model, tokenizers, modules: they live as long as it does)
    out of the garbage collector's reach. A full collection walks every tracked object while holding the GIL, so the
    engine thread waits for it mid-step: with the start-up objects in reach that was 100-180 ms on a 2-core host, a
    chat token 3-6x late; afterwards it walks only what requests created (vLLM freezes after start-up too)."""
    gc.collect()
    gc.freeze()


class _StopSignals:
    """SIGTERM and SIGINT on the running loop: the first starts the drain (and the tally of how requests end), a
    second aborts what still runs. `how` names the signal that ended it ("SIGTERM", "second SIGINT")."""

    def __init__(self, server: TandemServer, tally: ShutdownTally) -> None:
        self.server, self.tally = server, tally
        self.how = ""
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)

    async def wait(self) -> None:
        await self._stop.wait()

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._stop.is_set():
            log.warning("second %s: aborting %d in-flight requests and stopping now", name,
                        self.server.core.num_live)
            self.how = f"second {name}"
            self.server.abort()
            return
        log.warning("%s: stopping; in-flight requests get up to %.0fs to finish (--drain-timeout). "
                    "Press Ctrl-C again (or send %s again) to abort them and stop now",
                    name, self.server.config.drain_timeout_s, name)
        self.how = name
        self.tally.start()
        self._stop.set()


def _listeners(config: ServerConfig, metrics_port: int | None) -> list[ports.Listener]:
    """The fixed ports this server will listen on, each with the flag that moves it."""
    listeners = [ports.Listener("gRPC", config.port, "--port")]
    if config.http_port is not None:
        listeners.append(ports.Listener("HTTP", config.http_port, "--http-port", "--http-port off"))
    if metrics_port is not None and metrics_port >= 0:
        listeners.append(ports.Listener("Prometheus metrics", metrics_port, "--metrics-port", "--metrics-port off"))
    return listeners


async def _in_own_thread(fn: Callable, *args):
    """fn(*args) on a thread that ends when fn returns. Loading runs torch's OpenMP regions, and libgomp keeps a
    pool of workers for every thread that starts one, until that thread exits: a loader thread of asyncio's
    executor would keep its idle pool for the process's life beside the engine thread's, so OpenMP would count
    more threads than cores and cut every wait to its throttled spin count (none under PASSIVE), making each
    parallel region of a decode step wake a sleeping worker. The thread is a daemon, so a Ctrl-C while loading
    (the await is cancelled) stops the process at once instead of after the load."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def run() -> None:
        try:
            outcome = (fn(*args), None)
        except BaseException as exc:  # noqa: BLE001 (re-raised on the loop)
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, done, *outcome)
        except RuntimeError:  # the loop is closed: start-up was interrupted, nobody waits for the result
            pass

    thread = threading.Thread(target=run, name="tandem-load", daemon=True)
    thread.start()
    try:
        return await done
    finally:
        if not done.cancelled():  # it handed over its result or error: only its exit (and its OpenMP pool's) is left
            thread.join()


class StartupError(Exception):
    """The engine could not be built (bad path, unsupported model, no CUDA...): the CLI says it in one line."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


async def _serve_http(core: CoreAPI, config: ServerConfig, server: TandemServer, metrics: Metrics):
    """Start the HTTP door on the same loop and core API; OSError (one line naming --http-port) if it cannot bind."""
    if config.http_port is None:
        return None
    from service.http.server import HttpServer  # starlette and uvicorn only when HTTP is on

    door = HttpServer(core, config, config.http_port, serving=lambda: server.serving, registry=metrics.registry)
    await door.start()
    log.info("HTTP (OpenAI /v1/chat/completions, /v1/completions; rerank /v1/rerank, /v2/rerank, /rerank; "
             "embeddings %s; /metrics, /health, /ready) on %s",
             f"/v1/embeddings, /v2/embed, /embed, /embed_all with {core.info.embedder}" if core.info.embedder
             else "off", door.url)
    return door


def _serve_metrics(metrics: Metrics, host: str, port: int | None, healthy: Callable[[], bool],
                   hosts: tuple[str, ...] | None = None):
    """Start the /metrics and health endpoint, answering the Host headers the HTTP door answers (`hosts`);
    PortInUse (one line naming --metrics-port) if it cannot bind."""
    if port is None or port < 0:
        log.info("Prometheus metrics off (--metrics-port off)")
        return None
    try:
        http, _ = metrics.serve(host, port, healthy, hosts)
    except OSError as exc:
        listener = ports.Listener("Prometheus metrics", port, "--metrics-port", "--metrics-port off")
        raise ports.PortInUse(listener.problem(host, exc.strerror or str(exc))) from None
    log.info("Prometheus metrics on http://%s:%d/metrics, health on /health, /ready and /healthz", host,
             http.server_address[1])
    return http


async def _stop_metrics(http) -> None:
    """Stop the metrics endpoint on a thread (its serve_forever notices every 0.5 s) while the HTTP door stops."""
    if http is not None:
        await asyncio.to_thread(http.shutdown)


async def _stop_tracing(tracing: TracingHooks | None) -> None:
    if tracing is not None:
        await asyncio.to_thread(tracing.shutdown)  # bounded flush: a dead collector cannot hold up exit
