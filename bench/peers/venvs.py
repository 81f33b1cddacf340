"""The peers' virtual environments: sentence-transformers with ONNX Runtime, and Infinity, each in a venv made and
cached under ~/.cache/tandem/bench-venvs (pip, the local CPU torch wheel first), so `make test` never needs them.
bench/embed_speed.py runs them; bench/rag.py finds Infinity's here when it was made.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.peers import PeerUnavailable

VENVS = Path.home() / ".cache" / "tandem" / "bench-venvs"
ONNX_DIR = Path.home() / ".cache" / "tandem" / "onnx" / "all-MiniLM-L6-v2"
TORCH = "torch==2.13.0"  # first and alone: pip takes the local CPU wheel, never a CUDA build
# Each peer venv: pip install steps in order (the first is the CPU torch wheel).
PEERS = {
    # sentence-transformers 6.2 (the main venv's) cannot install with its onnx extra: it needs transformers 5, optimum-onnx
    # 0.1.0 needs transformers < 4.58; 5.1.2 is the ONNX peer.
    "onnx": [[TORCH], ["sentence-transformers[onnx]==5.1.2"]],
    "infinity": [[TORCH], ["infinity-emb[server,torch]==0.0.78"]],
}
WORKER = Path(__file__).with_name("st_worker.py")  # run by path, with -I: it imports nothing of tandem


def peer_python(name: str) -> Path:
    """The python of the cached venv for peer `name`, made (python -m venv + pip) when missing or stale."""
    venv = VENVS / name
    python = venv / "bin" / "python"
    marker = venv / ".tandem-installed"
    spec = json.dumps(PEERS[name])
    if python.is_file() and marker.is_file() and marker.read_text() == spec:
        return python
    VENVS.mkdir(parents=True, exist_ok=True)
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)]]
    steps += [[str(python), "-m", "pip", "install", "-q", *packages] for packages in PEERS[name]]
    for step in steps:
        print(f"peers: {' '.join(step)}", file=sys.stderr)
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            raise PeerUnavailable(f"`{' '.join(step[-3:])}` failed: {done.stderr.strip()[-600:]}")
    marker.write_text(spec)
    return python


def peer_versions(python: Path, names: list[str]) -> dict:
    code = ("import json, importlib.metadata as m, sys\nout = {}\nfor n in sys.argv[1:]:\n    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    return json.loads(subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True,
                                     check=True).stdout)


def thread_env(threads: int) -> dict:
    env = os.environ.copy()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    # DO_NOT_TRACK: Infinity's usage statistics (it would post them to a third party)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DO_NOT_TRACK="1")
    return env
