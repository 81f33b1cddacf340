"""The one way the benchmarks start servers in subprocesses: `tandem serve` of this checkout, and the peers' servers.

* `Spawned`: `tandem serve --port 0` (`python -m service.cli` from the repo root: the venv's `tandem` script may point
  at another checkout), ready once it prints its gRPC address; flags after the defaults override them
  (`--http-port N`, `--metrics-port N`).
* `Proc`: any server subprocess that answers GET /health once ready (llama-server, bench/peers/st_server.py,
  Infinity, or tandem's HTTP door: `tandem_proc`), pinned to `cores` with taskset when given, its log in a file.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from service.cluster import free_port

ROOT = Path(__file__).resolve().parents[1]


class Spawned:
    """`tandem serve --port 0` of this checkout in a subprocess, its gRPC door at `address`; `extra` flags come
    after `--http-port off --metrics-port off` and override them."""

    def __init__(self, extra: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", "0",
                                      "--http-port", "off", "--metrics-port", "off", *extra],
                                     cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=os.environ.copy())
        for line in self.proc.stdout:
            if line.startswith("tandem listening on "):
                self.address = line.split()[-1]
                return
        raise RuntimeError(f"tandem serve {' '.join(extra)} exited before listening")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(120)


class Proc:
    """A server subprocess that answers GET /health at `url` once ready."""

    embed_path = "/v1/embeddings"  # where it embeds (OpenAI's shape)
    rerank_by_embedding = False  # True: it has no /rerank for this model; clients rank by the embeddings' cosine
    rerank_model: str | None = None  # Infinity serving a cross-encoder beside the embedder: its /rerank's `model`

    def __init__(self, cmd: list[str], port: int, cores: str | None = None, env: dict | None = None) -> None:
        if cores is not None and shutil.which("taskset"):
            cmd = ["taskset", "-c", cores, *cmd]
        self.url = f"http://127.0.0.1:{port}"
        # Its log goes to a file, not a pipe: nobody reads a pipe while the phases run, and llama-server logs every
        # request, so after a few hundred its 64 KiB pipe buffer filled, its writes blocked and it stopped serving
        # mid-phase (the split runs that "hung" in W5, this session and the last).
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log, text=True,
                                     env={**os.environ, **(env or {})})
        import httpx

        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{cmd[0]} exited with {self.proc.returncode}: {self.log.read()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def tandem_proc(extra: list[str], cores: str | None = None) -> Proc:
    """`tandem serve` with its HTTP door on a free port, as a `Proc` (ready on the door's /health)."""
    port = free_port()
    return Proc([sys.executable, "-m", "service.cli", "serve", "--port", "0", "--http-port", str(port),
                 "--metrics-port", "off", "--no-access-log", *extra], port, cores)
