"""`tandem serve` as a real process: the one harness of every test of the process itself (start-up lines, signals,
exit codes, memory of its own, another model file), tests/service, tests/reliability and tests/bench alike. A test that
only needs a server uses the in-process `served` fixture (tests/service/conftest.py) or a `ServerThread`
(tests/service/harness.py) instead: no interpreter to start, no model to load again.

It waits on states (a line printed, the process's exit); every timeout here only turns a hang into a failure."""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
# This checkout's code, as `tandem serve` runs it (the console script calls service.cli:main; PYTHONPATH below makes
# the checkout win even where the venv's editable install points at another one).
SERVE = [sys.executable, "-m", "service.cli", "serve"]
HANG = 900  # a hang guard, never a time limit: start-up on a loaded 2-core machine may take minutes
LISTENING = "tandem listening on "


def serve_env(**extra: str) -> dict[str, str]:
    """The environment a `tandem serve` child gets: this process's, this checkout first on PYTHONPATH, then `extra`."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


class ServeProcess:
    """`tandem serve --port 0 --http-port off --metrics-port 0 ARGS` in a subprocess (a flag in ARGS wins over these
    defaults: argparse keeps the last), stdout and stderr together, read line by line as it is printed (lines keep
    their newline). Returns once the server listens: `address` is the gRPC address its "tandem listening on" line
    names. If the process exits first, RuntimeError carries everything it printed."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, **popen) -> None:
        self.proc = subprocess.Popen([*SERVE, "--port", "0", "--http-port", "off", "--metrics-port", "0", *args],
                                     cwd=ROOT, env=serve_env(**(env or {})), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, **popen)
        self.lines: queue.Queue[str | None] = queue.Queue()  # None: the output ended (the process exited)
        self.output: list[str] = []  # every line read so far
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self.address = self.wait_for(LISTENING, at_start=True).split()[-1]
        except AssertionError:
            raise RuntimeError("tandem serve exited early:\n" + self.text) from None

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    @property
    def text(self) -> str:
        """Everything read so far, as printed."""
        return "".join(self.output)

    def _next(self) -> str:
        line = self.lines.get(timeout=HANG)
        if line is None:
            self.lines.put(None)  # the end stays the end for the next reader
            raise EOFError
        self.output.append(line)
        return line

    def wait_until(self, found: Callable[[str], bool]) -> str:
        """Read lines until `found(everything read so far)` holds; that text. AssertionError if the process exits
        first."""
        while not found(self.text):
            try:
                self._next()
            except EOFError:
                raise AssertionError("tandem serve exited:\n" + "".join(self.output[-40:])) from None
        return self.text

    def wait_for(self, text: str, *, at_start: bool = False) -> str:
        """Read lines until one contains `text` (`at_start`: starts with it); that line. AssertionError if the process
        exits first."""
        while True:
            try:
                line = self._next()
            except EOFError:
                raise AssertionError(f"tandem serve exited before {text!r}:\n" + "".join(self.output[-40:])) from None
            if line.startswith(text) if at_start else text in line:
                return line

    def rest(self) -> list[str]:
        """Every line up to the end of the output (once the process has exited, or is exiting)."""
        try:
            while True:
                self._next()
        except EOFError:
            return self.output

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(60)


def serve_in_process(*argv: str) -> int:
    """`tandem serve --port 0 --http-port off --metrics-port off ARGV` in this process (service.cli.main), for a
    start-up that must fail before anything is served: no interpreter to start, torch already imported. It runs in a
    thread of its own, so a server that starts instead of failing fails the test after HANG rather than serving for
    ever. Returns its exit code; what it prints reaches the caller's capsys, what it logs caplog (pytest's handlers
    are on the root logger, so `--log-level` sets no handler of its own here: a traceback on stderr is a subprocess's
    to show)."""
    from service.cli import main

    result: list = []

    def run() -> None:
        try:
            result.append(main(["serve", "--port", "0", "--http-port", "off", "--metrics-port", "off", *argv]))
        except BaseException as exc:  # noqa: BLE001 (raised again in the caller's thread)
            result.append(exc)

    thread = threading.Thread(target=run, name="serve-in-process", daemon=True)
    thread.start()
    thread.join(HANG)
    assert result, f"tandem serve {' '.join(argv)} did not stop: it was meant to fail at start-up"
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]
