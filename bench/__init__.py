"""Benchmarks: every figure a ratio against a baseline run in the same process or run (DESIGN.md)."""
import os

# Before any benchmark loads torch (and its OpenMP): on shared cores, spinning OpenMP workers can slow a step many
# times over (see tests/conftest.py). Every system of a run gets the same setting; the JSON files record it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
