"""bench.thread_scaling's bookkeeping: what side by side gains over taking turns (no timing here)."""
from __future__ import annotations

import pytest

from bench.thread_scaling import side_by_side_gain


def test_kinds_that_scale_perfectly_gain_nothing_side_by_side():
    assert side_by_side_gain({"decode": 200.0, "embed": 40.0}, {"decode": 100.0, "embed": 20.0}) == pytest.approx(1.0)


def test_kinds_that_scale_poorly_gain_on_disjoint_cores():
    # each does 3/4 of its whole-machine rate on one core: together 1.5 machines' worth of the mix
    assert side_by_side_gain({"decode": 200.0, "embed": 40.0}, {"decode": 150.0, "embed": 30.0}) == pytest.approx(1.5)


def test_kinds_that_slow_each_other_down_can_lose():
    assert side_by_side_gain({"decode": 200.0, "embed": 40.0}, {"decode": 80.0, "embed": 16.0}) < 1.0
