"""Sampler: greedy, seeded sampling, top-k and top-p masks."""
from __future__ import annotations

import math

import pytest
import torch

from engine.config import SamplingParams
from engine.sampling import apply_top_k, apply_top_p, sample

NEG_INF = float("-inf")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def kept(logits: torch.Tensor) -> list[bool]:
    return torch.isfinite(logits).tolist()


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
def test_apply_top_k_keeps_exactly_the_k_largest(k):
    torch.manual_seed(k)
    logits = torch.randperm(10).float() * 0.5 - 2.0  # distinct values
    out = apply_top_k(logits, k)
    top = set(torch.topk(logits, k).indices.tolist())
    assert {i for i, f in enumerate(kept(out)) if f} == top
    assert all(out[i] == logits[i] for i in top)
    assert all(out[i] == NEG_INF for i in range(10) if i not in top)


def test_apply_top_k_rowwise():
    logits = torch.tensor([[1.0, 5.0, 3.0, 2.0], [9.0, 0.0, 8.0, 7.0]])
    assert kept(apply_top_k(logits, 2)) == [[False, True, True, False], [True, False, True, False]]


@pytest.mark.parametrize("k", [0, -1, 4, 100])
def test_apply_top_k_off(k):
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(apply_top_k(logits, k), logits)


# ---- top-p -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("p, expected", [
    (0.5, [True, False, False, False]),
    (0.8, [True, True, False, False]),
    (0.81, [True, True, True, False]),
    (0.97, [True, True, True, True]),
    (1e-6, [True, False, False, False]),  # at least the top token
])
def test_apply_top_p_minimal_nucleus(p, expected):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert kept(apply_top_p(probs.log(), p)) == expected


def test_apply_top_p_unsorted_input_and_rows():
    probs = torch.tensor([[0.05, 0.3, 0.5, 0.15], [0.15, 0.05, 0.3, 0.5]])
    out = apply_top_p(probs.log(), 0.81)
    assert kept(out) == [[False, True, True, True], [True, False, True, True]]
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], probs.log()[finite])  # kept logits unchanged


def test_apply_top_p_one_is_off():
    logits = torch.tensor([0.0, -50.0, 3.0])
    assert torch.equal(apply_top_p(logits, 1.0), logits)


# ---- masks honoured when sampling ------------------------------------------------------------------


def test_sampling_stays_inside_top_k():
    torch.manual_seed(4)
    logits = torch.randn(1, 40)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    p = SamplingParams(temperature=5.0, top_k=3, seed=0)  # hot: without the mask, others would show up
    g = gen(0)
    seen = {sample(logits, [p], [g])[0] for _ in range(300)}
    assert seen <= allowed
    assert len(seen) == 3


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


def test_top_k_and_top_p_combined():
    logits = torch.tensor([[2.0, 1.9, 1.8, 1.7, -5.0, -5.0]])
    p = SamplingParams(temperature=1.0, top_k=3, top_p=0.5, seed=0)
    masked = apply_top_p(apply_top_k(logits[0], 3), 0.5)
    allowed = {i for i, f in enumerate(kept(masked)) if f}
    assert allowed == {0, 1}
    g = gen(0)
    assert {sample(logits, [p], [g])[0] for _ in range(200)} == allowed


def test_sampled_frequencies_follow_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    p = SamplingParams(temperature=1.0, seed=0)
    g = gen(0)
    n = 2000
    counts = [0, 0, 0]
    for _ in range(n):
        counts[sample(probs.log().unsqueeze(0), [p], [g])[0]] += 1
    for c, q in zip(counts, probs.tolist()):
        assert abs(c / n - q) < 5 * math.sqrt(q * (1 - q) / n)


# ---- batched rows with their own settings ----------------------------------------------------------


def _sorted_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Top-p by sorting the whole row: the textbook definition the sampler's faster search must agree with."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    drop_sorted = (probs.cumsum(-1) - probs) >= p
    return logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), NEG_INF)


def test_per_row_top_k_matches_each_row_alone():
    torch.manual_seed(5)
    logits = torch.randn(4, 50)
    ks = [1, 0, 7, 50]
    out = apply_top_k(logits, ks)
    for row, k in enumerate(ks):
        assert torch.equal(out[row], apply_top_k(logits[row], k))
    assert [int(torch.isfinite(r).sum()) for r in out] == [1, 50, 7, 50]


@pytest.mark.parametrize("spread", [0.05, 1.0, 8.0])  # flat rows have nuclei far wider than the first search
def test_per_row_top_p_matches_the_full_sort(spread):
    torch.manual_seed(6)
    logits = torch.randn(5, 3000) * spread
    ps = [0.9, 1.0, 0.5, 0.999, 1e-6]
    out = apply_top_p(logits, ps)
    for row, p in enumerate(ps):
        assert kept(out[row]) == kept(_sorted_top_p(logits[row], p) if p < 1 else logits[row])
    assert torch.isfinite(out[1]).all()


def test_batched_rows_each_follow_their_own_distribution():
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.1, 0.1, 0.3, 0.5]])
    logits = probs.log()
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=2, seed=9)]
    rows = logits[[0, 1, 1, 1]]
    n = 2000
    counts = torch.zeros(4, 4)
    g = gen(9)
    torch.manual_seed(7)
    for _ in range(n):
        for row, token in enumerate(sample(rows, params, [None, None, None, g])):
            counts[row, token] += 1
    expected = [probs[0], torch.tensor([0.0, 0.0, 0.0, 1.0]), probs[1], torch.tensor([0.0, 0.0, 0.375, 0.625])]
    for row, q in enumerate(expected):
        for c, qq in zip(counts[row].tolist(), q.tolist()):
            assert abs(c / n - qq) <= 5 * math.sqrt(qq * (1 - qq) / n) + 1e-9, (row, counts[row])
