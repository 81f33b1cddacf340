"""Benchmarks: every figure a ratio against a baseline run in the same process or run (DESIGN.md).

Run them on an otherwise idle machine. On shared cores, spinning OpenMP workers can slow a step many times over
(tests/conftest.py sets OMP_WAIT_POLICY=PASSIVE for that reason); PASSIVE costs an idle machine ~15-20% per step,
so the benchmarks leave torch's default and record the policy in their JSON; such runs are flagged `contended`.
"""
