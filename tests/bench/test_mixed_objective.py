"""bench/mixed.py phase (d), the latency objective: its pure bookkeeping."""
from __future__ import annotations

import pytest

from bench import mixed


def test_objective_bookkeeping_picks_the_best_share_under_the_target_and_summarises_prediction_errors():
    from types import SimpleNamespace

    settings = [{"rerank_share": 0.1, "rerank_pairs_s": 5.0, "steady_tpot_p99_s": 0.05},
                {"rerank_share": 0.5, "rerank_pairs_s": 9.0, "steady_tpot_p99_s": 0.09},
                {"rerank_share": 0.3, "rerank_pairs_s": 7.0, "steady_tpot_p99_s": 0.07}]
    assert mixed.best_fixed_share(settings, 0.08, "steady_tpot_p99_s")["rerank_share"] == 0.3
    assert mixed.best_fixed_share(settings, 0.01, "steady_tpot_p99_s") is None
    rec = lambda d, p, dec: SimpleNamespace(duration_s=d, predicted_s=p, decode_tokens=dec,  # noqa: E731
                                            prediction_error=None if p is None else (d - p) / d)
    errors = mixed.prediction_errors([rec(1.0, 0.9, 4), rec(1.0, 1.2, 0), rec(2.0, None, 4), rec(1.0, 1.0, 4)])
    assert errors["all_steps"]["steps"] == 3 and errors["decode_steps"]["steps"] == 2
    assert errors["all_steps"]["median"] == pytest.approx(0.1)
