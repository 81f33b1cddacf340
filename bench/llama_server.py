"""llama.cpp's own `llama-server` as the CPU peer of the generation benchmarks: built once, cached, driven over HTTP.

Build (`ensure_llama_server()`, which `make bench` runs through `python -m bench.llama_server`): the llama.cpp source
vendored in the llama-cpp-python sdist (pinned below, from PyPI like every other package here), configured with
`GGML_NATIVE=ON` (this CPU's vector units: AVX-512 VNNI where it has them), static libraries, target `llama-server`
only. Several minutes on 2 cores; the binary is cached under ~/.cache/tandem/llama.cpp/<version>/ and reused. A
second build, `isa="avx2"` (`python -m bench.llama_server --isa avx2`), turns the native detection off and AVX-512 off
(`GGML_NATIVE=OFF GGML_AVX2=ON GGML_AVX512=OFF GGML_FMA=ON GGML_F16C=ON`), cached beside the native one in `avx2/`,
so an AVX-512 host can compare tandem's AVX2 path (`TANDEM_CPU_ISA=avx2`) with llama.cpp's AVX2 code. A
failed build raises `PeerUnavailable` with the reason, which the benchmarks write into their JSON and go on without
the peer. `make test` never needs any of this.

Driving it: `LlamaServer` starts the binary on a loopback port with the same GGUF file, the same threads (`-t`,
`-tb`) and `-np` slots, waits for `/health`, and `complete()` sends token ids to its native `/completion` endpoint
(greedy, EOS ignored, no prompt cache) and reads the streamed tokens with their arrival times.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from service.cluster import free_port

SDIST = "llama-cpp-python==0.3.36"
CACHE = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "llama.cpp" / "0.3.36"
# The builds: where each is cached, and the CMake switches that pick its CPU code.
BUILDS = {
    "native": (CACHE / "llama-server", ["-DGGML_NATIVE=ON"]),
    "avx2": (CACHE / "avx2" / "llama-server", ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
                                              "-DGGML_AVX512=OFF", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]),
}


class PeerUnavailable(RuntimeError):
    """llama-server could not be built or started; the message says why."""


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise PeerUnavailable(f"`{' '.join(cmd[:4])} ...` failed (exit {proc.returncode}):\n{tail}")


def ensure_llama_server(jobs: int | None = None, isa: str = "native") -> Path:
    """The cached llama-server binary of build `isa` (a key of BUILDS), built from the sdist's vendored llama.cpp on
    first use."""
    if isa not in BUILDS:
        raise ValueError(f"unknown llama-server build {isa!r}; expected one of {', '.join(BUILDS)}")
    binary, switches = BUILDS[isa]
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    if shutil.which("cmake") is None:
        raise PeerUnavailable("cmake is not installed (apt-get install cmake): llama-server cannot be built")
    print(f"llama_server: building the {isa} llama-server from the {SDIST} sdist into {binary.parent} "
          "(once; several minutes on 2 cores)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="tandem-llamacpp-") as tmp:
        work = Path(tmp)
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST,
              "-d", str(work)])
        archive = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        src = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = work / "build"
        _run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *switches,
              "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF"])
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 2)])
        binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", binary)
    return binary


@dataclass(slots=True)
class Completion:
    tokens: list[int]
    times: list[float]  # perf_counter at each token's arrival
    start: float  # perf_counter when the request was sent


class LlamaServer:
    """A running llama-server on loopback; a context manager that stops it on exit."""

    def __init__(self, model: Path, *, threads: int, slots: int, ctx_per_slot: int, isa: str = "native") -> None:
        self.binary = ensure_llama_server(isa=isa)
        self.port = free_port()
        self.slots = slots
        # -c is the whole context, split evenly over the -np slots; --no-cont-batching is NOT set: its default
        # continuous batching over the slots is what users run. -ub/-b: llama.cpp's defaults.
        self.cmd = [str(self.binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                    "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(ctx_per_slot * slots),
                    "--no-warmup", "--log-disable"]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while True:  # wait on the server's own health state, or on its exit
            if self.proc.poll() is not None:
                raise PeerUnavailable(f"llama-server exited with {self.proc.returncode}: "
                                      f"{self.proc.stderr.read()[-2000:] if self.proc.stderr else ''}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                ok = conn.getresponse().status == 200
                conn.close()
                if ok:
                    return self
            except OSError:
                pass
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def complete(self, token_ids: list[int], max_tokens: int) -> Completion:
        """Greedy, EOS ignored, streamed; the prompt is sent as token ids (no BOS added, no template applied)."""
        body = json.dumps({"prompt": token_ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                           "samplers": ["top_k"], "ignore_eos": True, "cache_prompt": False, "stream": True,
                           "return_tokens": True})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        start = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise PeerUnavailable(f"llama-server answered {resp.status}: {resp.read()[:500]!r}")
        tokens: list[int] = []
        times: list[float] = []
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            msg = json.loads(line[5:])
            new = msg.get("tokens") or []
            now = time.perf_counter()
            tokens.extend(new)
            times.extend([now] * len(new))
            if msg.get("stop"):
                break
        conn.close()
        return Completion(tokens, times, start)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="build (once) and print the cached llama-server")
    ap.add_argument("--isa", choices=list(BUILDS), default="native")
    try:
        print(ensure_llama_server(isa=ap.parse_args().isa))
    except PeerUnavailable as exc:  # `make bench` goes on: the benchmarks say the peer is missing and why
        print(f"llama-server not available: {exc}", file=sys.stderr)
