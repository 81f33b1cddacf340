"""`tandem cluster` as a real process for the scale-out tests: its stdout lines, pids, and replica metrics."""
from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from service.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
TANDEM = str(Path(sys.executable).parent / "tandem")
# Small and quiet on a shared 2-core machine: one torch thread per replica, sleeping OpenMP workers.
SERVE_ARGS = ("--num-threads", "1", "--max-num-seqs", "16", "--num-kv-blocks", "512", "--max-documents", "8")
REPLICA_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TANDEM_LOG_LEVEL": "WARNING"}


@dataclass
class ReplicaInfo:
    name: str
    pid: int
    address: str
    metrics_url: str
    http_address: str = ""


class ClusterProcess:
    """Starts `tandem cluster --replicas 2` with a hashing and a round-robin frontend; parses what it prints."""

    def __init__(self, replicas: int = 2, *extra: str, serve_args: tuple[str, ...] = ()) -> None:
        self.port, self.roundrobin_port, self.http_port = free_port(), free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self.roundrobin_address = f"127.0.0.1:{self.roundrobin_port}"
        self.run_dir = Path(tempfile.mkdtemp(prefix="tandem-cluster-test-"))
        self.log_path = self.run_dir.with_suffix(".log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [TANDEM, "cluster", "--replicas", str(replicas), "--port", str(self.port), "--http-port", str(self.http_port),
             "--roundrobin-port", str(self.roundrobin_port), "--run-dir", str(self.run_dir / "run"),
             "--check-inter-ms", "300", "--check-fall", "2", "--check-rise", "1", "--drain-timeout", "60",
             *extra, "--", *SERVE_ARGS, *serve_args],
            cwd=ROOT, env={**os.environ, **REPLICA_ENV}, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.replicas: dict[str, ReplicaInfo] = {}
        self.haproxy_pid = 0
        threading.Thread(target=self._pump, daemon=True).start()
        self.wait_for("tandem cluster ready", timeout=900)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout: float = 900) -> str:
        """Consume stdout lines up to the first one starting with prefix, keeping track of replica pids.

        It waits for the line (a state), not for a time: the timeout only turns a hang into a failure, so it is far
        longer than a start or restart takes on a loaded 2-core machine."""
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line within {timeout}s\n{self.log_tail()}") from None
            if line is None:
                raise AssertionError(f"tandem cluster exited ({self.proc.wait()}) before {prefix!r}\n{self.log_tail()}")
            if m := re.match(r"replica (\S+) pid (\d+) grpc (\S+) metrics (\S+) http (\S+)", line):
                self.replicas[m[1]] = ReplicaInfo(m[1], int(m[2]), m[3], m[4], m[5])
            elif m := re.match(r"replica (\S+) restarted pid (\d+)", line):
                self.replicas[m[1]].pid = int(m[2])
            elif m := re.search(r"haproxy pid (\d+)", line):
                self.haproxy_pid = int(m[1])
            if line.startswith(prefix):
                return line

    def log_tail(self, n: int = 60) -> str:
        self._log.flush()
        return "".join(self.log_path.read_text().splitlines(keepends=True)[-n:])

    def by_address(self, address: str) -> ReplicaInfo:
        return next(r for r in self.replicas.values() if r.address == address)

    def counters(self) -> dict[str, dict[str, float]]:
        """Cluster-wide prompt and prefix-cache-hit tokens by kind ("all": both), summed over the replicas."""
        totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for replica in self.replicas.values():
            text = urllib.request.urlopen(replica.metrics_url, timeout=10).read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in ("tandem_prompt_tokens_total", "tandem_prefix_cache_hit_tokens_total"):
                        totals[sample.labels["kind"]][sample.name] += sample.value
                        totals["all"][sample.name] += sample.value
        return totals

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for pid in [r.pid for r in self.replicas.values()] + [self.haproxy_pid]:
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._log.close()
        code = self.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.log_path.unlink(missing_ok=True)
        return code


def alive(pid: int) -> bool:
    """A live process (zombies of our own children count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def hit_rate(before: dict, after: dict, kind: str) -> float:
    prompt = after[kind]["tandem_prompt_tokens_total"] - before[kind]["tandem_prompt_tokens_total"]
    hits = after[kind]["tandem_prefix_cache_hit_tokens_total"] - before[kind]["tandem_prefix_cache_hit_tokens_total"]
    assert prompt > 0, (kind, before, after)
    return hits / prompt
