"""The Triton kernels build for sm_80 and sm_90, checked without a GPU (see tests/kernels/gpu_compile.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_nvidia_gpus() -> None:
    # A fresh process: this one already holds interpreted kernels (TRITON_INTERPRET=1 from conftest).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.kernels.gpu_compile"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    assert lines and all(line.startswith("ok ") for line in lines), run.stdout
    assert {line.split()[1] for line in lines} == {"sm_80", "sm_90"}
