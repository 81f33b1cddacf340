"""Bookkeeping of bench/single.py without models: the token-agreement figure beside each speed figure."""
from bench import single


def test_agreement_reports_identity_first_difference_and_share():
    ref = [1, 2, 3, 4]
    assert single.agreement([1, 2, 3, 4], ref) == {"identical": True, "first_difference": None,
                                                   "same_position_share": 1.0}
    diverged = single.agreement([1, 2, 9, 4], ref)
    assert diverged == {"identical": False, "first_difference": 2, "same_position_share": 0.75}
