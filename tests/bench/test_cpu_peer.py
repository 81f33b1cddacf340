"""Bookkeeping of bench/cpu_peer.py without servers: prompt windows, the token-agreement figure, the CPU it records and
the llama-server builds it may ask for."""
import random
from pathlib import Path

import pytest

from bench.cpu_peer import agreement, cpu_identity, windows
from bench.llama_server import ensure_llama_server


def test_windows_are_slices_of_the_pool_with_the_asked_lengths():
    pool = list(range(1000))
    got = windows(pool, [16, 256, 999], random.Random(0))
    assert [len(w) for w in got] == [16, 256, 999]
    for w in got:  # contiguous runs of the pool: real text, not a shuffle
        assert w == pool[w[0]:w[0] + len(w)]


def test_agreement_names_the_first_difference_per_prompt():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = agreement([[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]], ref)
    assert got == {"identical_share": 1 / 3, "first_difference": [None, 2, 0]}


def test_the_cpu_identity_names_this_cpus_vector_flags() -> None:
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    ident = cpu_identity()
    if not flags:
        assert ident == {} or not ident["vector_flags"]
        return
    assert ident["model"] and ident["vector_flags"] and set(ident["vector_flags"]) <= flags
    assert {"avx2", "fma"} & flags <= set(ident["vector_flags"])  # what the AVX2 comparison is about


def test_an_unknown_llama_server_build_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown llama-server build"):
        ensure_llama_server(isa="avx9")
