"""`tandem serve --drain-grace`: on SIGTERM /healthz turns 503 at once while new work is still taken for the
grace (so a load balancer's health check can notice), then new work is refused and in-flight work finishes."""
from __future__ import annotations

import os
import signal
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest

from clients import AsyncClient, TandemError
from service.cluster import free_port
from tests.cluster.harness import REPLICA_ENV, ROOT, SERVE_ARGS, TANDEM


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=120) as reply:  # a guard, not a speed bound
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture
def graced():
    port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen([TANDEM, "serve", *SERVE_ARGS, "--port", str(port), "--metrics-port", str(metrics_port),
                             "--http-port", "off", "--drain-grace", "600"], cwd=ROOT, env={**os.environ, **REPLICA_ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("tandem listening on "):
            break
    yield proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/healthz"
    if proc.poll() is None:
        proc.kill()
    proc.wait(120)


async def test_sigterm_reports_not_serving_first_and_serves_through_the_grace(graced):
    proc, address, health = graced
    assert _health(health) == 200
    async with AsyncClient(address, max_retries=0) as client:
        proc.send_signal(signal.SIGTERM)
        while _health(health) != 503:  # no sleeps: it flips as soon as the signal is handled
            assert proc.poll() is None, "the server exited on the first SIGTERM instead of draining"
        # Inside the (long) grace: NOT_SERVING, yet new work is served, not refused.
        assert (await client.rerank("capital of France", ["Paris.", "Bananas."])).replica == address
        assert (await client.complete("Hi", max_tokens=2, ignore_eos=True)).finish_reason == "length"
        proc.send_signal(signal.SIGTERM)  # a second signal stops now: new work is refused while the server closes
        while True:
            try:
                await client.rerank("q", ["d"])
            except TandemError as exc:
                refused = exc
                break
    # "server is draining" if the call arrived before the transport closed; after, grpc's own UNAVAILABLE, or
    # CANCELLED for a call the closing server was already holding
    assert refused.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert proc.wait(600) == 0  # a guard: a loaded host may take a while to close
