"""Bookkeeping of bench/cpu_peer.py without servers: prompt windows and the token-agreement figure."""
import random

from bench.cpu_peer import agreement, windows


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
