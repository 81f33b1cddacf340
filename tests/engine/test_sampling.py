"""Sampler: greedy, seeded sampling, top-k and top-p masks."""
from __future__ import annotations

import math

import pytest
import torch

from engine.config import SamplingParams
from engine.sampling import FIRST_CANDIDATES, candidate_mask, sample

NEG_INF = float("-inf")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def kept(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> set[int]:
    """Token ids a row of logits may still sample after top-k and top-p."""
    values, ids = candidate_mask(logits.unsqueeze(0).softmax(-1), [top_k], [top_p])
    return set(ids[0][values[0] > 0].tolist())


# ---- greedy ----------------------------------------------------------------------------------------


def test_greedy_is_argmax_per_row():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    params = [SamplingParams(temperature=0.0)] * 5
    assert sample(logits, params, [None] * 5) == logits.argmax(dim=-1).tolist()


def test_greedy_ignores_top_k_top_p_and_seed():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    p = SamplingParams(temperature=0.0, top_k=2, top_p=0.1, seed=3)
    for s in range(5):
        assert sample(logits, [p], [gen(s)]) == [1]


def test_mixed_batch_greedy_rows_stay_argmax():
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, seed=2)]
    out = sample(logits, params, [None, gen(1), None, gen(2)])
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert all(0 <= t < 30 for t in out)


def test_very_low_temperature_matches_argmax():
    torch.manual_seed(2)
    logits = torch.randn(3, 40)
    params = [SamplingParams(temperature=1e-4)] * 3
    out = sample(logits, params, [gen(i) for i in range(3)])
    assert out == logits.argmax(dim=-1).tolist()


# ---- seeds -----------------------------------------------------------------------------------------


def _draws(seed: int, logits: torch.Tensor, n: int = 12, **kw) -> list[int]:
    p = SamplingParams(temperature=1.0, seed=seed, **kw)
    g = gen(seed)
    return [sample(logits, [p], [g])[0] for _ in range(n)]


def test_same_seed_same_tokens():
    logits = torch.zeros(1, 100)  # flat: every draw is informative
    assert _draws(7, logits) == _draws(7, logits)
    assert _draws(7, logits, top_k=10, top_p=0.9) == _draws(7, logits, top_k=10, top_p=0.9)


def test_different_seed_different_tokens():
    logits = torch.zeros(1, 100)
    a, b, c = _draws(1, logits), _draws(2, logits), _draws(3, logits)
    assert a != b and b != c and a != c
    assert len(set(a)) > 1  # the generator advances between draws


def test_seeded_row_does_not_depend_on_batch_neighbours():
    torch.manual_seed(3)
    logits = torch.randn(3, 64)
    p = SamplingParams(temperature=1.0, seed=11)
    g = gen(11)
    alone = [sample(logits[1:2], [p], [g])[0] for _ in range(8)]
    g = gen(11)
    others = [SamplingParams(temperature=1.0), p, SamplingParams(temperature=0.7, seed=5)]
    g5 = gen(5)
    batched = [sample(logits, others, [None, g, g5])[1] for _ in range(8)]
    assert batched == alone


# ---- top-k -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 5, 9])
def test_top_k_keeps_exactly_the_k_largest(k):
    torch.manual_seed(k)
    logits = torch.randperm(10).float() * 0.5 - 2.0  # distinct values
    assert kept(logits, top_k=k) == set(torch.topk(logits, k).indices.tolist())


@pytest.mark.parametrize("k", [0, -1, 4, 100])
def test_top_k_off(k):
    assert kept(torch.tensor([1.0, 2.0, 3.0, 4.0]), top_k=k) == {0, 1, 2, 3}


# ---- top-p -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("p, expected", [
    (0.5, {0}),
    (0.8, {0, 1}),
    (0.81, {0, 1, 2}),
    (0.97, {0, 1, 2, 3}),
    (1e-6, {0}),  # at least the top token
])
def test_top_p_minimal_nucleus(p, expected):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert kept(probs.log(), top_p=p) == expected


def test_top_p_unsorted_input():
    assert kept(torch.tensor([0.05, 0.3, 0.5, 0.15]).log(), top_p=0.81) == {1, 2, 3}
    assert kept(torch.tensor([0.15, 0.05, 0.3, 0.5]).log(), top_p=0.81) == {0, 2, 3}


def test_top_p_one_is_off():
    assert kept(torch.tensor([0.0, -50.0, 3.0]), top_p=1.0) == {0, 1, 2}


def test_top_p_renormalises_over_the_top_k():
    # top_k 3 leaves probabilities ~[0.37, 0.33, 0.30]: top_p 0.5 then needs two of them (of the full softmax,
    # the top token would hold less than half too, but the third would not be reached).
    assert kept(torch.tensor([2.0, 1.9, 1.8, 1.7, -5.0, -5.0]), top_k=3, top_p=0.5) == {0, 1}
    assert kept(torch.tensor([2.0, 1.9, 1.8, 1.7, -5.0, -5.0]), top_k=3, top_p=0.7) == {0, 1, 2}


def _sorted_nucleus(logits: torch.Tensor, p: float) -> set[int]:
    """Top-p by sorting the whole row: the textbook definition the sampler's candidate search must agree with."""
    probs, order = torch.sort(logits.softmax(-1), descending=True)
    return set(order[(probs.cumsum(-1) - probs) < p].tolist())


@pytest.mark.parametrize("spread", [0.05, 1.0, 8.0])  # flat rows have nuclei far wider than the first candidates
def test_per_row_settings_match_each_row_alone_and_the_full_sort(spread):
    torch.manual_seed(6)
    logits = torch.randn(5, 3000) * spread
    ks, ps = [0, 7, 0, 2999, 0], [0.9, 1.0, 0.5, 0.999, 1e-6]
    values, ids = candidate_mask(logits.softmax(-1), ks, ps)
    for row, (k, p) in enumerate(zip(ks, ps)):
        batched = set(ids[row][values[row] > 0].tolist())
        assert batched == kept(logits[row], top_k=k, top_p=p)
        if k == 0:
            assert batched == _sorted_nucleus(logits[row], p)
    assert len(set(ids[1][values[1] > 0].tolist())) == 7
    if spread == 0.05:
        assert values.shape[-1] > FIRST_CANDIDATES  # the nucleus of row 0 forced a wider search


# ---- masks honoured when sampling ------------------------------------------------------------------


def test_sampling_stays_inside_top_k():
    torch.manual_seed(4)
    logits = torch.randn(1, 40)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    p = SamplingParams(temperature=5.0, top_k=3, seed=0)  # hot: without the mask, others would show up
    g = gen(0)
    seen = {sample(logits, [p], [g])[0] for _ in range(300)}
    assert seen == allowed


def test_sampling_stays_inside_top_p_nucleus():
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    logits = probs.log().unsqueeze(0)
    p = SamplingParams(temperature=1.0, top_p=0.6, seed=0)
    g = gen(0)
    seen = {sample(logits, [p], [g])[0] for _ in range(300)}
    assert seen == {0, 1}


def test_top_p_applies_to_the_temperature_scaled_distribution():
    # At temperature 1: probs [0.5, 0.3, 0.15, 0.05], top_p 0.81 keeps 3 tokens.
    # At temperature 0.25 the top token alone holds > 0.81 of the mass.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    scaled = (logits / 0.25).softmax(-1)
    assert scaled[0, 0] > 0.81
    p = SamplingParams(temperature=0.25, top_p=0.81, seed=0)
    g = gen(0)
    assert {sample(logits, [p], [g])[0] for _ in range(200)} == {0}


def test_top_k_and_top_p_combined_when_sampling():
    logits = torch.tensor([[2.0, 1.9, 1.8, 1.7, -5.0, -5.0]])
    p = SamplingParams(temperature=1.0, top_k=3, top_p=0.5, seed=0)
    g = gen(0)
    assert {sample(logits, [p], [g])[0] for _ in range(200)} == {0, 1}


def _frequencies_match(counts: list[float], probs: list[float], n: int) -> None:
    for c, q in zip(counts, probs):
        assert abs(c / n - q) <= 5 * math.sqrt(q * (1 - q) / n) + 1e-9, (counts, probs)


def test_sampled_frequencies_follow_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    p = SamplingParams(temperature=1.0, seed=0)
    g = gen(0)
    n = 2000
    counts = [0, 0, 0]
    for _ in range(n):
        counts[sample(probs.log().unsqueeze(0), [p], [g])[0]] += 1
    _frequencies_match(counts, probs.tolist(), n)


def test_batched_rows_each_follow_their_own_distribution():
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.1, 0.1, 0.3, 0.5]])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=2, seed=9), SamplingParams(temperature=1.0, top_p=0.75)]
    rows = probs.log()[[0, 1, 1, 1, 1]]
    n = 2000
    counts = torch.zeros(5, 4)
    g = gen(9)
    torch.manual_seed(7)
    for _ in range(n):
        for row, token in enumerate(sample(rows, params, [None, None, None, g, None])):
            counts[row, token] += 1
    expected = [probs[0].tolist(), [0, 0, 0, 1], probs[1].tolist(), [0, 0, 0.375, 0.625], [0, 0, 0.375, 0.625]]
    for row, q in enumerate(expected):
        _frequencies_match(counts[row].tolist(), q, n)


def test_draws_at_the_ends_of_the_unit_interval_never_pick_a_zero_probability_token():
    from engine.sampling import _inverse_cdf, _sample_candidates

    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]] * 2)
    ends = torch.tensor([0.0, 1.0 - 2**-24])  # the smallest and largest values torch.rand returns
    assert _inverse_cdf(probs, ends).tolist() == [1, 2]
    assert _sample_candidates(probs, [0, 0], [0.99, 0.99], ends).tolist() == [1, 2]
    # u * total rounding up to total: the clamp lands on the zero tail, and the draw falls back to the mode.
    assert _inverse_cdf(probs, torch.tensor([1.0, 1.0])).tolist() == [1, 1]


def test_only_rows_with_wide_nuclei_search_further_and_every_row_stays_exact():
    torch.manual_seed(8)
    flat, peaked, medium = torch.randn(3000) * 0.05, torch.randn(3000) * 8, torch.randn(3000) * 2.0
    logits = torch.stack([peaked, flat, medium, peaked])
    ps = [0.9, 0.9, 0.95, 0.5]
    values, ids = candidate_mask(logits.softmax(-1), [0, 0, 0, 3], ps)
    assert values.shape[-1] > FIRST_CANDIDATES  # the flat row's nucleus needed more candidates
    for row, p in enumerate(ps[:3]):
        assert set(ids[row][values[row] > 0].tolist()) == _sorted_nucleus(logits[row], p)
    assert set(ids[3][values[3] > 0].tolist()) == kept(peaked, top_k=3, top_p=0.5)
    # Three widths: the peaked rows end in the first search, the medium one in the second, the flat one in the last.
    assert len(_sorted_nucleus(peaked, 0.9)) < FIRST_CANDIDATES < len(_sorted_nucleus(medium, 0.95)) < 8 * FIRST_CANDIDATES
    assert len(_sorted_nucleus(flat, 0.9)) > 8 * FIRST_CANDIDATES
