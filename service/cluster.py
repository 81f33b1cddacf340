"""`tandem cluster`: N `tandem serve` replicas on loopback ports behind HAProxy, with rolling restarts.

HAProxy (not a router of ours) does the routing for both doors: consistent hashing on the `x-tandem-prefix`
metadata (gRPC, on --port) or header (HTTP, on --http-port; without it, the OpenAI `user` field of the JSON body),
so a chat's next turn or a query's next batch lands on the replica whose prefix cache holds it. Each replica
serves HTTP /healthz next to /metrics (503 once it drains), which HAProxy checks.

Signals: SIGINT/SIGTERM stop everything this started (replicas drain first); SIGHUP, or
`tandem cluster --port P --rolling-restart`, restarts the replicas one at a time: the replica is taken out
of rotation, drains (in-flight work finishes), exits, comes back on the same ports, and is back in rotation
before the next one goes. Imports no torch.
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Callable, TextIO

from service.http.hosts import is_loopback

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "deploy" / "haproxy.cfg.tmpl"
BACKEND = "tandem"
_PR_SET_PDEATHSIG = 1


class ClusterError(RuntimeError):
    pass


class _Stop(Exception):
    """A stop signal arrived while the cluster was busy (starting, restarting)."""


@dataclass(slots=True)
class ClusterConfig:
    replicas: int = 2
    host: str = "127.0.0.1"  # where HAProxy listens; replicas always listen on 127.0.0.1
    port: int = 50051
    http_port: int = 8000  # HAProxy's HTTP frontend (the replicas' HTTP doors behind it)
    roundrobin_port: int | None = None  # also a plain round-robin frontend (for comparisons)
    serve_args: list[str] = field(default_factory=list)  # passed to every `tandem serve`
    check_inter_ms: int = 500
    check_fall: int = 2
    check_rise: int = 2
    drain_grace_s: float | None = None  # default: long enough for HAProxy to see a failed check `fall` times
    drain_timeout_s: float = 30.0
    start_timeout_s: float = 300.0
    respawn: bool = True  # restart a replica that exits on its own
    haproxy: str = "haproxy"
    template: Path = TEMPLATE
    run_dir: Path | None = None  # default: <tmp>/tandem-cluster-<port>
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the replicas

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        if not 0 < self.http_port < 65536 or self.http_port == self.port:
            raise ValueError(f"--http-port must be a port in [1, 65535] other than --port, got {self.http_port}")
        if self.check_inter_ms < 10 or self.check_fall < 1 or self.check_rise < 1:
            raise ValueError("health checks need --check-inter-ms >= 10, --check-fall >= 1, --check-rise >= 1")
        if self.drain_grace_s is None:
            self.drain_grace_s = self.check_inter_ms * (self.check_fall + 1) / 1000 + 0.5
        if self.run_dir is None:
            self.run_dir = Path(tempfile.gettempdir()) / f"tandem-cluster-{self.port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the cluster process dies, however it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Replica:
    """One `tandem serve` process on fixed loopback ports (the same ports across restarts)."""

    def __init__(self, name: str, port: int, metrics_port: int, http_port: int, cfg: ClusterConfig,
                 log: Callable[[str], None]):
        self.name, self.port, self.metrics_port, self.http_port = name, port, metrics_port, http_port
        self.address = f"127.0.0.1:{port}"
        self.http_address = f"127.0.0.1:{http_port}"
        self.health_url = f"http://127.0.0.1:{metrics_port}/healthz"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self._cfg = cfg
        self._log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cfg = self._cfg
        command = [sys.executable, "-m", "service.cli", "serve", *cfg.serve_args, "--host", "127.0.0.1",
                   "--port", str(self.port), "--http-port", str(self.http_port),
                   "--metrics-port", str(self.metrics_port),
                   "--drain-grace", str(cfg.drain_grace_s), "--drain-timeout", str(cfg.drain_timeout_s)]
        if not is_loopback(cfg.host) and "--allowed-hosts" not in cfg.serve_args:
            # HAProxy listens beyond loopback and passes the clients' Host on: the replicas (on 127.0.0.1) answer
            # what it answers, as a replica bound there would (service/http/hosts.py)
            command += ["--allowed-hosts", "*"]
        env = {**os.environ, **cfg.env}
        env.setdefault("TANDEM_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.replicas)))
        # Own process group: a terminal's Ctrl-C reaches the cluster only, which then drains replicas in order.
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, process_group=0,
                                     preexec_fn=_die_with_parent)
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self._log(f"[{self.name}] {line.rstrip()}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=1.0) as reply:
                return reply.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def signal(self, signum: int) -> None:
        if self.alive:
            self.proc.send_signal(signum)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._log(f"{self.name} did not exit in {timeout:.0f}s: killing it")
            self.proc.kill()
            return self.proc.wait(10)


class Cluster:
    """Replicas plus HAProxy. `start()`, then `rolling_restart()` any number of times, then `stop()`."""

    def __init__(self, cfg: ClusterConfig, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        self.cfg = cfg
        self._out, self._err = out, err
        self._lock = threading.Lock()
        self.haproxy: subprocess.Popen | None = None
        self.replicas: list[Replica] = []
        self.stopping: Callable[[], bool] = lambda: False  # set by run(): raise _Stop when true

    # ---- output --------------------------------------------------------------------------------------

    def say(self, line: str) -> None:
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()

    def log(self, line: str) -> None:
        with self._lock:
            self._err.write(line + "\n")
            self._err.flush()

    # ---- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.cfg
        if shutil.which(cfg.haproxy) is None:
            raise ClusterError(f"HAProxy not found ({cfg.haproxy!r} is not on PATH): install it, e.g. "
                               "`apt-get install -y haproxy` (Debian/Ubuntu) or `make cluster`, or pass --haproxy")
        if not Path(cfg.template).is_file():
            raise ClusterError(f"HAProxy config template {cfg.template} not found (--haproxy-template)")
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / "cluster.pid").write_text(f"{os.getpid()}\n")
        self.replicas = [Replica(f"r{i}", free_port(), free_port(), free_port(), cfg, self.log)
                         for i in range(cfg.replicas)]
        for replica in self.replicas:
            replica.start()
        for replica in self.replicas:
            self._wait_healthy(replica)
            self.say(f"replica {replica.name} pid {replica.proc.pid} grpc {replica.address} "
                     f"metrics {replica.metrics_url} http {replica.http_address}")
        self._start_haproxy()
        for replica in self.replicas:
            self._wait_state(replica, "UP")
        rr = f", round-robin on {cfg.host}:{cfg.roundrobin_port}" if cfg.roundrobin_port else ""
        self.say(f"tandem cluster ready on {cfg.host}:{cfg.port}, HTTP on {cfg.host}:{cfg.http_port} "
                 f"({len(self.replicas)} replicas, consistent hashing on x-tandem-prefix{rr}; "
                 f"haproxy pid {self.haproxy.pid})")

    def _start_haproxy(self) -> None:
        cfg = self.cfg
        path = cfg.run_dir / "haproxy.cfg"
        path.write_text(self.render())
        check = subprocess.run([cfg.haproxy, "-c", "-q", "-f", str(path)], capture_output=True, text=True)
        if check.returncode != 0:
            raise ClusterError(f"HAProxy rejected {path}:\n{check.stdout}{check.stderr}")
        self.haproxy = subprocess.Popen([cfg.haproxy, "-db", "-f", str(path)], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        process_group=0, preexec_fn=_die_with_parent)
        threading.Thread(target=self._pump_haproxy, daemon=True).start()

    def _pump_haproxy(self) -> None:
        for line in self.haproxy.stdout:
            self.log(f"[haproxy] {line.rstrip()}")

    def render(self) -> str:
        cfg = self.cfg
        servers = "\n".join(f"    server {r.name} {r.address} proto h2 port {r.metrics_port} check-proto h1"
                            for r in self.replicas)
        # The HTTP doors follow their replica's health (and maintenance) as HAProxy sees it in the gRPC backend.
        http_servers = "\n".join(f"    server {r.name} {r.http_address} track {BACKEND}/{r.name}"
                                 for r in self.replicas)
        extra = ""
        if cfg.roundrobin_port:
            tracked = "\n".join(f"    server {r.name} {r.address} proto h2 track {BACKEND}/{r.name}"
                                for r in self.replicas)
            extra = (f"frontend tandem_roundrobin\n    bind {cfg.host}:{cfg.roundrobin_port} proto h2\n"
                     f"    default_backend tandem_roundrobin\n\n"
                     f"backend tandem_roundrobin\n    balance roundrobin\n{tracked}\n")
        return Template(Path(cfg.template).read_text()).substitute(
            bind=cfg.host, port=cfg.port, http_port=cfg.http_port, stats_socket=str(cfg.run_dir / "haproxy.sock"),
            check_inter=f"{cfg.check_inter_ms}ms", check_fall=cfg.check_fall, check_rise=cfg.check_rise,
            servers=servers, http_servers=http_servers, extra=extra)

    def rolling_restart(self) -> None:
        """One replica at a time: out of rotation, drain, exit, start on the same ports, back in rotation."""
        self.log("rolling restart")
        for replica in self.replicas:
            self.restart(replica)
        self.say("rolling restart done")

    def restart(self, replica: Replica) -> None:
        if replica.alive:
            self.admin(f"set server {BACKEND}/{replica.name} state maint")  # no new work from HAProxy
            replica.signal(signal.SIGTERM)  # NOT_SERVING, grace, drain in-flight work, exit
            code = replica.wait_exit(self.cfg.drain_grace_s + self.cfg.drain_timeout_s + 30)
            self.log(f"{replica.name} exited with {code}")
        replica.start()
        self._wait_healthy(replica)
        self.admin(f"set server {BACKEND}/{replica.name} state ready")
        self._wait_state(replica, "UP")
        self.say(f"replica {replica.name} restarted pid {replica.proc.pid}")

    def respawn_dead(self) -> None:
        for replica in self.replicas:
            if not replica.alive:
                self.log(f"{replica.name} exited with {replica.proc.returncode}: starting it again")
                self.restart(replica)

    def stop(self) -> None:
        """Replicas drain and exit, then HAProxy; whatever is left after the timeouts is killed."""
        for replica in self.replicas:
            replica.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.drain_grace_s + self.cfg.drain_timeout_s + 10
        for replica in self.replicas:
            if replica.proc is not None:
                replica.wait_exit(max(0.1, deadline - time.monotonic()))
        if self.haproxy is not None and self.haproxy.poll() is None:
            self.haproxy.terminate()
            try:
                self.haproxy.wait(10)
            except subprocess.TimeoutExpired:
                self.haproxy.kill()
                self.haproxy.wait(10)
        shutil.rmtree(self.cfg.run_dir, ignore_errors=True)

    def kill(self) -> None:
        """Second Ctrl-C: no draining."""
        for proc in [r.proc for r in self.replicas] + [self.haproxy]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(self.cfg.run_dir, ignore_errors=True)

    # ---- HAProxy admin socket ------------------------------------------------------------------------

    def admin(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5.0)
            s.connect(str(self.cfg.run_dir / "haproxy.sock"))
            s.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def server_states(self) -> dict[str, str]:
        """HAProxy's view of each replica in the hashing backend: "UP", "DOWN", "MAINT", "UP 1/2", ..."""
        try:
            text = self.admin("show stat").lstrip("# ")
        except OSError:  # HAProxy is still starting
            return {}
        return {row["svname"]: row["status"] for row in csv.DictReader(io.StringIO(text))
                if row.get("pxname") == BACKEND and row.get("svname") not in ("FRONTEND", "BACKEND")}

    # ---- waiting -------------------------------------------------------------------------------------

    def _wait(self, what: str, done: Callable[[], bool], timeout: float, check: Callable[[], None]) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if self.stopping():
                raise _Stop()
            check()
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.05)

    def _wait_healthy(self, replica: Replica) -> None:
        def check() -> None:
            if not replica.alive:
                raise ClusterError(f"replica {replica.name} exited with {replica.proc.returncode} while starting "
                                   "(its log lines are above)")
        self._wait(f"{replica.name} to report healthy on {replica.health_url}", replica.healthy,
                   self.cfg.start_timeout_s, check)

    def _wait_state(self, replica: Replica, state: str) -> None:
        def check() -> None:
            if self.haproxy.poll() is not None:
                raise ClusterError(f"HAProxy exited with {self.haproxy.returncode} (its log lines are above)")
        self._wait(f"HAProxy to see {replica.name} {state}",
                   lambda: self.server_states().get(replica.name) == state, 60, check)


# ---- the command ---------------------------------------------------------------------------------------


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cluster", help="N serve replicas behind HAProxy (prefix-aware routing)",
        description="Start N `tandem serve` replicas on loopback ports and HAProxy in front of them on --port, "
                    "hashing x-tandem-prefix consistently. Ctrl-C stops everything; SIGHUP (or "
                    "--rolling-restart) restarts the replicas one at a time without failing requests. "
                    "Arguments after `--` go to every `tandem serve`.")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--port", type=int, default=50051, help="HAProxy's gRPC port (h2c)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="HAProxy's HTTP port (OpenAI, Cohere/Jina, TEI APIs), hashed like gRPC")
    p.add_argument("--host", default="127.0.0.1", help="HAProxy's bind address (0.0.0.0: all interfaces)")
    p.add_argument("--roundrobin-port", type=int, default=None,
                   help="also serve a plain round-robin frontend here (to compare against hashing)")
    p.add_argument("--check-inter-ms", type=int, default=500, help="HAProxy health-check interval")
    p.add_argument("--check-fall", type=int, default=2, help="failed checks before a replica is out")
    p.add_argument("--check-rise", type=int, default=2, help="passed checks before a replica is back")
    p.add_argument("--drain-grace", type=float, default=None,
                   help="seconds a stopping replica keeps taking work while HAProxy notices "
                        "(default: check interval x (fall + 1) + 0.5)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight work gets when draining")
    p.add_argument("--no-respawn", dest="respawn", action="store_false",
                   help="leave a replica that exits on its own down (default: start it again)")
    p.add_argument("--haproxy", default="haproxy", help="the haproxy binary")
    p.add_argument("--haproxy-template", type=Path, default=TEMPLATE)
    p.add_argument("--run-dir", type=Path, default=None,
                   help="HAProxy config, admin socket and pid file (default: <tmp>/tandem-cluster-<port>)")
    p.add_argument("--rolling-restart", action="store_true",
                   help="ask the cluster already running on --port to restart its replicas one at a time, then exit")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `tandem serve` flags for every replica")
    p.set_defaults(run=None)


def _config(args: argparse.Namespace) -> ClusterConfig:
    serve_args = list(args.serve_args)
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    return ClusterConfig(replicas=args.replicas, host=args.host, port=args.port, http_port=args.http_port,
                         roundrobin_port=args.roundrobin_port, serve_args=serve_args,
                         check_inter_ms=args.check_inter_ms, check_fall=args.check_fall,
                         check_rise=args.check_rise, drain_grace_s=args.drain_grace,
                         drain_timeout_s=args.drain_timeout, respawn=args.respawn, haproxy=args.haproxy,
                         template=args.haproxy_template, run_dir=args.run_dir)


def _signal_running(cfg: ClusterConfig) -> int:
    pid_file = cfg.run_dir / "cluster.pid"
    try:
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGHUP)
    except (OSError, ValueError) as exc:
        print(f"tandem cluster: no running cluster for port {cfg.port} ({pid_file}: {exc})", file=sys.stderr)
        return 1
    print(f"rolling restart requested from cluster pid {pid}")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        cfg = _config(args)
    except ValueError as exc:
        print(f"tandem cluster: {exc}", file=sys.stderr)
        return 2
    if args.rolling_restart:
        return _signal_running(cfg)
    cluster = Cluster(cfg)
    pending: list[int] = []  # signals, appended by the handlers (atomic) and consumed by the loop below
    stop_signals = (signal.SIGINT, signal.SIGTERM)
    cluster.stopping = lambda: any(s in stop_signals for s in pending)
    for signum in (*stop_signals, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: pending.append(signum))
    code = 0
    try:
        _supervise(cluster, cfg, pending)
    except _Stop:
        pass
    except ClusterError as exc:
        print(f"tandem cluster: {exc}", file=sys.stderr)
        code = 1
    finally:
        # A second Ctrl-C while draining kills everything at once.
        signal.signal(signal.SIGINT, lambda signum, frame: cluster.kill() or os._exit(130))
        cluster.log("stopping: replicas drain, then HAProxy")
        cluster.stop()
        cluster.say("tandem cluster stopped")
    return code


def _supervise(cluster: Cluster, cfg: ClusterConfig, pending: list[int]) -> None:
    cluster.start()
    while not cluster.stopping():
        if signal.SIGHUP in pending:
            pending.remove(signal.SIGHUP)
            cluster.rolling_restart()
        elif cfg.respawn:
            cluster.respawn_dead()
        if cluster.haproxy.poll() is not None:
            raise ClusterError(f"HAProxy exited with {cluster.haproxy.returncode}")
        time.sleep(0.1)
