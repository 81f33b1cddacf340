"""llama.cpp's own `llama-server` (and `llama-quantize`, `convert_hf_to_gguf.py`) as the CPU peer of the generation
benchmarks: built once, cached, driven over HTTP.

Source: the llama.cpp tree vendored in the llama-cpp-python sdist (pinned below, from PyPI like every other package
here). `source_tree()` finds it in this order: the extracted tree in the cache (`src/`, below); the sdist named by
TANDEM_LLAMA_CPP_SDIST (a .tar.gz, an extracted sdist directory, or its vendor/llama.cpp directory itself); an sdist
.tar.gz already in the cache directory; else `pip download` of the sdist into the cache. It is extracted once and
kept, because `convert_hf_to_gguf.py` (with its `conversion/` and `gguf-py/`) runs from it (bench/big_model.py).

Builds (`ensure_build()`; `python -m bench.peers.llama_server [--build avx2 avx512]`, default: the builds this CPU runs):
CMake, Release, static libraries, targets `llama-server` and `llama-quantize`, several minutes each on 2 cores,
cached and reused:

* `avx2`: `GGML_NATIVE=OFF`, AVX/AVX2/FMA/F16C on, AVX-512 off: what most users' CPUs run, and what tandem's
  forced AVX2 path (`TANDEM_CPU_ISA=avx2`) is compared with;
* `avx512`: the same plus AVX-512 with VNNI and VBMI (BF16 off), AMX explicitly off: llama.cpp's best on an AVX-512
  host (its `GGML_NATIVE` build can die of SIGILL on VMs that advertise AMX; on one AVX-512 host its AVX2 build
  even ran batch 1 faster than the native one, so the benchmark runs both and compares with the faster);
* `native`: `GGML_NATIVE=ON` (this CPU's own detection), kept as an option; the comparison does not use it.

Cache layout (TANDEM_CACHE, default ~/.cache/tandem; populate it by hand from builds made elsewhere by copying the
two binaries and the source tree into these places):

    ~/.cache/tandem/llama.cpp/0.3.36/
        llama_cpp_python-0.3.36.tar.gz          the sdist, when this module downloaded it
        src/                                    the sdist's vendor/llama.cpp, extracted (convert_hf_to_gguf.py here)
        avx2/llama-server   avx2/llama-quantize
        avx512/llama-server avx512/llama-quantize
        native/llama-server native/llama-quantize

A failed build raises `PeerUnavailable` with the reason, which the benchmarks write into their JSON and go on
without the peer. `make test` never needs any of this.

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
from enum import StrEnum
from pathlib import Path

from bench.peers import PeerUnavailable
from service.cluster import free_port

VERSION = "0.3.36"
SDIST = f"llama-cpp-python=={VERSION}"
SDIST_ENV = "TANDEM_LLAMA_CPP_SDIST"
TOOLS = ("llama-server", "llama-quantize")


class Build(StrEnum):
    """A llama.cpp build: which vector code its CPU backend was compiled with."""
    AVX2 = "avx2"
    AVX512 = "avx512"
    NATIVE = "native"


_X86 = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
        "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
# The CMake switches that pick each build's CPU code (besides the common ones of `ensure_build`).
SWITCHES: dict[Build, list[str]] = {
    Build.AVX2: _X86 + ["-DGGML_AVX512=OFF"],
    Build.AVX512: _X86 + ["-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON",
                          "-DGGML_AVX512_BF16=OFF"],
    Build.NATIVE: ["-DGGML_NATIVE=ON"],
}
BUILDS = tuple(b.value for b in Build)  # the names the command lines accept


def cache_dir() -> Path:
    """~/.cache/tandem/llama.cpp/<version> (TANDEM_CACHE moves the ~/.cache/tandem part)."""
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "llama.cpp" / VERSION


def source_dir() -> Path:
    """Where the extracted llama.cpp source lives in the cache."""
    return cache_dir() / "src"


def tool_path(build: Build | str, tool: str = "llama-server") -> Path:
    """The cached binary `tool` (llama-server or llama-quantize) of `build`; it may not exist yet."""
    if tool not in TOOLS:
        raise ValueError(f"unknown llama.cpp tool {tool!r}; expected one of {', '.join(TOOLS)}")
    return cache_dir() / _build(build).value / tool


def _build(build: Build | str) -> Build:
    try:
        return Build(build)
    except ValueError:
        raise ValueError(f"unknown llama-server build {build!r}; expected one of {', '.join(BUILDS)}") from None


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise PeerUnavailable(f"`{' '.join(cmd[:4])} ...` failed (exit {proc.returncode}):\n{tail}")


def _is_tree(path: Path) -> bool:
    return (path / "CMakeLists.txt").is_file() and (path / "convert_hf_to_gguf.py").is_file()


def _given_sdist() -> Path | None:
    """What TANDEM_LLAMA_CPP_SDIST names, else an sdist archive already in the cache."""
    given = os.environ.get(SDIST_ENV, "").strip()
    if given:
        path = Path(given).expanduser()
        if not path.exists():
            raise PeerUnavailable(f"{SDIST_ENV}={given}: no such file or directory")
        return path
    found = sorted(cache_dir().glob("llama_cpp_python-*.tar.gz"))
    return found[-1] if found else None


def source_tree() -> Path:
    """The llama.cpp source tree of the sdist, extracted once into the cache (see the module's docstring for where it
    is looked for first)."""
    target = source_dir()
    if _is_tree(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    origin = _given_sdist()
    if origin is None:
        print(f"llama_server: downloading the {SDIST} sdist into {target.parent} (once)", file=sys.stderr, flush=True)
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST,
              "-d", str(target.parent)])
        origin = next(target.parent.glob("llama_cpp_python-*.tar.gz"))
    with tempfile.TemporaryDirectory(prefix="src-", dir=target.parent) as tmp:
        work = Path(tmp)
        if origin.is_file():
            with tarfile.open(origin) as tar:
                tar.extractall(work, filter="data")
            tree = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
        else:
            tree = origin if _is_tree(origin) else origin / "vendor" / "llama.cpp"
        if tree is None or not _is_tree(tree):
            raise PeerUnavailable(f"{origin} holds no llama.cpp source tree (vendor/llama.cpp with CMakeLists.txt "
                                  "and convert_hf_to_gguf.py)")
        staged = work / "tree"
        # A tree made elsewhere may hold its own build directories: not part of the source.
        shutil.copytree(tree, staged, symlinks=True, ignore=lambda d, names: [
            n for n in names if Path(d) == tree and n.startswith("build")])
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
    return target


def ensure_build(build: Build | str = Build.AVX2, jobs: int | None = None) -> Path:
    """The cache directory of `build`, holding llama-server and llama-quantize, built from the sdist's llama.cpp on
    first use."""
    build = _build(build)
    directory = cache_dir() / build.value
    if all(os.access(directory / t, os.X_OK) and (directory / t).is_file() for t in TOOLS):
        return directory
    if shutil.which("cmake") is None:
        raise PeerUnavailable("cmake is not installed (apt-get install cmake): llama-server cannot be built")
    src = source_tree()
    print(f"llama_server: building the {build} llama-server and llama-quantize from {src} into {directory} "
          "(once; several minutes on 2 cores)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="tandem-llamacpp-") as tmp:
        out = Path(tmp) / "build"
        _run(["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", *SWITCHES[build],
              "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF"])
        _run(["cmake", "--build", str(out), "--target", *TOOLS, "-j", str(jobs or os.cpu_count() or 2)])
        directory.mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            shutil.copy2(out / "bin" / tool, directory / tool)
    return directory


def ensure_llama_server(jobs: int | None = None, isa: Build | str = Build.NATIVE) -> Path:
    """The cached llama-server binary of build `isa` (a Build), built on first use."""
    return ensure_build(isa, jobs) / "llama-server"


@dataclass(frozen=True, slots=True)
class Tools:
    """llama.cpp's own model tools: the quantizer binary and the HF -> GGUF converter script (run with this venv's
    Python; it imports the gguf-py beside it)."""
    quantize: Path
    convert: Path


def llama_tools(build: Build | str = Build.AVX2) -> Tools:
    """llama-quantize of `build` (the file it writes does not depend on the build) and convert_hf_to_gguf.py from the
    cached source tree; both made on first use."""
    return Tools(ensure_build(build) / "llama-quantize", source_tree() / "convert_hf_to_gguf.py")


def host_builds(vector_flags: list[str] | set[str]) -> list[Build]:
    """The builds this CPU runs and the comparison uses: avx2 always, avx512 where the CPU has the AVX-512 parts it
    was compiled with (F, BW, VL, VNNI, VBMI)."""
    need = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi"}
    return [Build.AVX2] + ([Build.AVX512] if need <= set(vector_flags) else [])


@dataclass(slots=True)
class Completion:
    tokens: list[int]
    times: list[float]  # perf_counter at each token's arrival
    start: float  # perf_counter when the request was sent


class LlamaServer:
    """A running llama-server on loopback; a context manager that stops it on exit."""

    def __init__(self, model: Path, *, threads: int, slots: int, ctx_per_slot: int,
                 isa: Build | str = Build.NATIVE) -> None:
        self.binary = ensure_llama_server(isa=isa)
        self.build = Build(isa)
        self.port = free_port()
        self.slots = slots
        # -c is the whole context, split evenly over the -np slots; --no-cont-batching is NOT set: its default
        # continuous batching over the slots is what users run. -ub/-b: llama.cpp's defaults.
        self.cmd = [str(self.binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                    "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(ctx_per_slot * slots),
                    "--no-warmup", "--log-disable"]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        # stderr to a file, not a pipe nobody reads while it serves: a full 64 KiB pipe blocks the server's writes
        # and it stops serving (bench/pipeline.py's split runs hung so)
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        while True:  # wait on the server's own health state, or on its exit
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise PeerUnavailable(f"llama-server exited with {self.proc.returncode}: {self.log.read()[-2000:]}")
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
            self.log.close()

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

    ap = argparse.ArgumentParser(description="build (once) and print the cached llama.cpp builds and source tree")
    ap.add_argument("--build", "--isa", nargs="+", choices=BUILDS, default=None,
                    help="default: the builds this CPU runs (avx2, and avx512 where it has AVX-512)")
    ap.add_argument("--source-only", action="store_true", help="only extract the source tree (no compile)")
    args = ap.parse_args()
    if args.build is None:
        from bench.host import cpu_identity

        args.build = host_builds(cpu_identity().get("vector_flags", []))
    try:
        print(source_tree())
        for name in [] if args.source_only else args.build:
            print(ensure_build(name))
    except PeerUnavailable as exc:  # `make bench` goes on: the benchmarks say the peer is missing and why
        print(f"llama.cpp not available: {exc}", file=sys.stderr)
