"""Test harness: a real TandemServer on its own uvloop thread (as another process would be), and helpers."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import defaultdict

import uvloop

from service.bridge import EngineBridge
from service.core import CoreAPI
from service.lifecycle import Hooks, RequestLifecycle
from service.server import ServerConfig, TandemServer


class Recorder(Hooks):
    """Keeps every finished request's lifecycle, by the id its client chose."""

    def __init__(self) -> None:
        self.finished: dict[str, list[RequestLifecycle]] = defaultdict(list)
        self.refused: list[RequestLifecycle] = []  # answered with an error before the engine admitted them
        self.steps = 0
        self._changed = threading.Condition()

    def on_finish(self, lc: RequestLifecycle) -> None:
        with self._changed:
            self.finished[lc.client_id].append(lc)
            self._changed.notify_all()

    def wait_finished(self, match, timeout: float = 120) -> list[RequestLifecycle]:
        """Block until some finished lifecycle satisfies `match` (a hang guard, not a time limit); those that do."""
        def found() -> list[RequestLifecycle]:
            return [lc for lcs in list(self.finished.values()) for lc in lcs if match(lc)]
        with self._changed:
            if not self._changed.wait_for(found, timeout):
                raise TimeoutError("no finished request matched")
            return found()

    def on_refused(self, lc: RequestLifecycle) -> None:
        self.refused.append(lc)

    def on_step(self, record) -> None:
        self.steps += 1


class ServerThread:
    """An EngineBridge plus one or more TandemServers, served by a uvloop in a background thread."""

    def __init__(self, engine, config: ServerConfig, *, max_waiting: int = 256) -> None:
        self.recorder = Recorder()
        self.bridge = EngineBridge(engine, max_waiting=max_waiting, hooks=[self.recorder])
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self._thread.start()
        self._servers: list[TandemServer] = []
        self._http: list = []  # HttpServer
        self.core = self.call(self._start_bridge(config)).result(120)
        self.server = self.add_server(config)
        self.address = self.server.address

    async def _start_bridge(self, config: ServerConfig) -> CoreAPI:
        self.bridge.start()
        return await CoreAPI.load(self.bridge, config.limits(), config.names(), config.tool_settings())

    def call(self, coro) -> concurrent.futures.Future:
        """Run a coroutine on the server's loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def acall(self, coro):
        """Await a coroutine that runs on the server's loop, from another loop."""
        return await asyncio.wrap_future(self.call(coro))

    def add_server(self, config: ServerConfig) -> TandemServer:
        """Another listening server on the same bridge (e.g. with TLS and auth)."""
        server = TandemServer(self.core, config)
        self.call(server.start()).result(60)
        self._servers.append(server)
        return server

    def add_http(self, config: ServerConfig):
        """An HTTP door (service/http/) on the same bridge, on an ephemeral port; returns the HttpServer."""
        from service.http.server import HttpServer

        door = HttpServer(self.core, config, 0, serving=lambda: self.server.serving)
        self.call(door.start()).result(120)
        self._http.append(door)
        return door

    def stop_http(self, door) -> None:
        self.call(door.stop()).result(60)
        self._http.remove(door)

    async def idle_stats(self) -> dict:
        """Engine stats once no request is live (what leak assertions read)."""
        async def settle() -> dict:
            await asyncio.wait_for(self.bridge.wait_idle(), 120)
            return await self.bridge.stats()
        return await self.acall(settle())

    def close(self) -> None:
        async def shutdown() -> None:
            for door in self._http:
                await door.stop()
            for server in self._servers:
                await server.stop()
            await self.bridge.stop()
        self.call(shutdown()).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def assert_all_blocks_free(stats: dict) -> None:
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_requests"] == 0, stats
    assert stats["bridge_live"] == 0 and stats["bridge_waiting"] == 0, stats
