"""The packed encoder's own pieces against plain references: the longest-first reordering and the last layer's
first-token-only attention (tests/engine/test_cross_encoder.py checks whole models against transformers)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.bert import first_token_attention, longest_first


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


def test_longest_first_moves_whole_sequences_stably() -> None:
    lengths = [2, 5, 1, 5, 3]
    cu = _cu(lengths)
    ids = torch.arange(sum(lengths)) * 10
    order, (moved,), new_cu = longest_first(cu, ids)
    assert order.tolist() == [1, 3, 4, 0, 2]  # equal lengths keep their input order
    assert (new_cu[1:] - new_cu[:-1]).tolist() == [5, 5, 3, 2, 1]
    bounds = cu.tolist()
    want = torch.cat([ids[bounds[i]:bounds[i + 1]] for i in order.tolist()])
    assert torch.equal(moved, want)


def test_longest_first_leaves_sorted_batches_alone() -> None:
    cu = _cu([4, 4, 2])
    ids = torch.arange(10)
    order, (same,), same_cu = longest_first(cu, ids)
    assert order is None and same is ids and same_cu is cu


def test_first_token_attention_is_the_first_row_of_full_attention() -> None:
    lengths = [7, 1, 300, 33]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 4, 16, generator=g) for _ in range(3))
    cu = _cu(lengths)
    first = cu[:-1].long()
    got = first_token_attention(q[first], k, v, cu, 0.25)
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        want = F.scaled_dot_product_attention(q[s:s + 1].transpose(0, 1), k[s:e].transpose(0, 1),
                                              v[s:e].transpose(0, 1), scale=0.25).transpose(0, 1)[0]
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)
