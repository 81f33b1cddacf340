"""`tandem serve`: load the engine, start the bridge and the server, drain on SIGTERM/SIGINT, exit 0."""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable

from service.bridge import EngineBridge
from service.lifecycle import LifecycleHooks
from service.server import ServerConfig, TandemServer

log = logging.getLogger("tandem.serve")


async def serve(engine_config, server_config: ServerConfig, *, max_waiting: int,
                ready: Callable[[str], None] = print, hooks: tuple[LifecycleHooks, ...] = ()) -> int:
    """Serve until SIGTERM or SIGINT; the first drains, a second one aborts what is still running."""
    from engine import LLMEngine  # torch only here, so client commands stay light

    engine = await asyncio.to_thread(LLMEngine, engine_config)
    bridge = EngineBridge(engine, max_waiting=max_waiting, hooks=hooks)
    bridge.start()
    server = TandemServer(bridge, server_config)
    try:
        address = await server.start()
    except OSError as exc:
        log.error("%s", exc)
        await bridge.stop()
        return 1
    ready(address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("second %s: aborting in-flight requests", signal.Signals(signum).name)
            bridge.abort_all()
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await stop.wait()
    log.info("draining (up to %.0fs)", server_config.drain_timeout_s)
    await server.drain()
    await bridge.stop()
    return 0
