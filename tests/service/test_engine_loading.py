"""`tandem serve` loads the engine on a thread that ends, so its OpenMP pool ends with it (issue #28 item 4).

libgomp keeps a pool of worker threads for every thread that runs a parallel region, for as long as that thread
lives. Had the engine been loaded on a thread of asyncio's executor (which lives on), the process would keep that
pool beside the engine thread's and count more OpenMP threads than cores, and libgomp then cuts every wait to its
throttled spin count: each parallel region of a decode step would wake a sleeping worker.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from service.serve import _in_own_thread

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")


def os_threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def parallel_work() -> float:
    """A reduction big enough for torch to run it as an OpenMP parallel region on two threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return float(torch.ones(8_000_000).sum())
    finally:
        torch.set_num_threads(previous)


def wait_for(predicate, what: str, deadline_s: float = 120.0) -> None:
    end = time.monotonic() + deadline_s  # a bound on a state, not a length of time the test relies on
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"still waiting for {what}")
        time.sleep(0.01)


def test_the_loader_thread_and_its_openmp_workers_end_when_loading_returns():
    async def scenario() -> None:
        await _in_own_thread(parallel_work)  # once first: torch and libgomp start a thread of their own for good
        before = os_threads()
        seen: list[tuple[int, set[str]]] = []

        def load() -> float:
            value = parallel_work()
            seen.append((threading.get_native_id(), os_threads()))  # this thread and its pool's worker are alive
            return value

        assert await _in_own_thread(load) == 8_000_000.0
        loader, during = seen[0]
        started = during - before  # the loader and the OpenMP worker(s) of its pool
        assert str(loader) in started and len(started) >= 2, "the parallel region ran without an OpenMP worker"
        # still inside the running loop, as in `tandem serve`: an executor thread would live on here. The OS thread
        # outlives Python's join by its last steps (libgomp's pool teardown among them), so wait for it to go.
        wait_for(lambda: not os.path.exists(f"/proc/self/task/{loader}"), "the thread that loaded to exit")
        wait_for(lambda: not started & os_threads(), "the loader's OpenMP worker to exit")

    asyncio.run(scenario())


def test_an_error_while_loading_reaches_the_caller_and_the_thread_still_ends():
    def fail() -> None:
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        asyncio.run(_in_own_thread(fail))
    assert not any(t.name.startswith("tandem-load") for t in threading.enumerate())
