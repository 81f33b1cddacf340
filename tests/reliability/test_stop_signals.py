"""`tandem serve` (service/serve.py's `serve`, run in a child process since signals are sent to it):

* it handles its stop signals from the moment it says it is ready: a SIGTERM sent as soon as the ready line appears
  (what tests/cluster/test_drain_grace.py and an orchestrator do) drains the replica and it exits 0. Before, the
  handlers were installed just after the ready line; on a loaded host a SIGTERM could land in between, the default
  action killed the process, and the next /healthz probe got a connection reset instead of 503 (issue 72). Here the
  signal is sent from inside the ready callback itself, so the gap is hit every time, not by chance;
* its metrics port checks the Host header as the HTTP door does (a loopback bind answers loopback names only).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import asyncio, json, logging, os, signal, sys, urllib.error, urllib.request
from engine import EngineConfig
from service.cluster import free_port
from service.config import ServerConfig
from service.serve import serve

metrics_port = free_port()

def status(path, host):
    request = urllib.request.Request(f"http://127.0.0.1:{metrics_port}{path}", headers={"Host": host})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:  # a guard, not a speed bound
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code

def ready(address):
    checks = {f"{path} {host}": status(path, host) for path in ("/metrics", "/healthz")
              for host in ("localhost", f"127.0.0.1:{metrics_port}", "rebound.example")}
    print("ready", address, json.dumps(checks), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # delivered before kill() returns: the handler must be in place already

logging.basicConfig(level="INFO")
config = EngineConfig(model=sys.argv[1], tpot_target_ms=None, num_kv_blocks=32)
rc = asyncio.run(serve(config, ServerConfig(host="127.0.0.1", port=0, http_port=None), max_waiting=4, ready=ready,
                       metrics_port=metrics_port, access_log=False))
print("returned", rc, flush=True)
"""


@pytest.fixture(scope="module")
def served_once(tiny_model_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(tiny_model_dir)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # a guard, not a speed bound


def test_a_sigterm_sent_the_moment_serve_says_ready_drains_it_and_it_exits_0(served_once):
    out = served_once
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-2000:])  # -15: killed by its own SIGTERM
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ready 127.0.0.1:") and lines[-1] == "returned 0"
    assert "tandem serve stopped (SIGTERM)" in out.stderr  # the drain ran to its last log line


def test_the_metrics_port_answers_the_hosts_the_http_door_answers(served_once):
    checks = json.loads(served_once.stdout.splitlines()[0].split(" ", 2)[2])
    for path in ("/metrics", "/healthz"):
        assert checks[f"{path} localhost"] == 200 and checks[f"{path} 127.0.0.1:{_port(checks)}"] == 200, checks
        assert checks[f"{path} rebound.example"] == 400, checks  # DNS rebinding: a page's own name, now 127.0.0.1


def _port(checks: dict) -> str:
    return next(k for k in checks if "127.0.0.1:" in k).rsplit(":", 1)[1]
