"""Benchmarks: every figure is a ratio against a baseline timed in the same run (transformers, or tandem itself in
another setting: decode alone vs mixed, prefix cache off vs on) on the same model, inputs and torch threads, so a
slower or busier host moves both sides of the ratio. Absolute figures are recorded beside it, for context only.

Run them on an otherwise idle machine. On shared cores, spinning OpenMP workers can slow a step many times over
(tests/conftest.py sets OMP_WAIT_POLICY=PASSIVE for that reason; `tandem serve` adds a short GOMP_SPINCOUNT, see
docs/cli.md); in process the benchmarks leave torch's default and record the policy in their JSON; runs on a
loaded host are flagged `contended`.
"""
