"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, for all rows of a step at once.

Sampling draws one uniform number per row and inverts the row's cumulative distribution (a cumsum and a
searchsorted): on CPU torch.multinomial and a full-vocabulary sort each take tens of milliseconds per row, which
made a step of 128 sampled sequences spend seconds here. Top-p looks for the nucleus in the row's top 256
probabilities first and sorts more only when the nucleus is wider than that.
"""
from __future__ import annotations

import torch

from engine.config import SamplingParams

_NUCLEUS_FIRST_K = 256


def apply_top_k(logits: torch.Tensor, k: int | list[int]) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the k-th value survive); the rest become -inf.

    `k` is one value for every row or one per row; 0, negative or >= the vocabulary: that row is untouched."""
    vocab = logits.shape[-1]
    rows = logits if logits.dim() == 2 else logits.unsqueeze(0)
    ks = [k] * rows.shape[0] if isinstance(k, int) else list(k)
    ks = [kk if 0 < kk < vocab else vocab for kk in ks]
    if all(kk == vocab for kk in ks):
        return logits
    top = torch.topk(rows, max(ks), dim=-1).values
    kth = top.gather(-1, torch.tensor(ks, device=rows.device).unsqueeze(-1) - 1)
    kth = kth.masked_fill(torch.tensor([kk == vocab for kk in ks], device=rows.device).unsqueeze(-1),
                          float("-inf"))
    return rows.masked_fill(rows < kth, float("-inf")).view_as(logits)


def apply_top_p(logits: torch.Tensor, p: float | list[float]) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability mass reaches p (always at least one; ties with
    the last kept token are kept too). `p` is one value for every row or one per row; 1.0: untouched."""
    rows = logits if logits.dim() == 2 else logits.unsqueeze(0)
    ps = [p] * rows.shape[0] if isinstance(p, (int, float)) else list(p)
    active = [i for i, pp in enumerate(ps) if pp < 1.0]
    if not active:
        return logits
    x = rows[active] if len(active) < len(ps) else rows
    probs = x.softmax(dim=-1)
    target = torch.tensor([ps[i] for i in active], device=x.device, dtype=probs.dtype).unsqueeze(-1)
    vocab = x.shape[-1]
    k = min(_NUCLEUS_FIRST_K, vocab)
    while True:
        top = torch.topk(probs, k, dim=-1).values  # descending: a prefix of the fully sorted row
        kept = ((top.cumsum(dim=-1) - top) < target).sum(dim=-1, keepdim=True).clamp(min=1)
        if k == vocab or bool((kept < k).all()):  # every nucleus ends inside the top k
            break
        k = min(vocab, k * 8)
    threshold = top.gather(-1, kept - 1)
    masked = x.masked_fill(probs < threshold, float("-inf"))
    if len(active) == len(ps):
        return masked.view_as(logits)
    out = rows.clone()
    out[active] = masked
    return out.view_as(logits)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits [N, V] (fp32)."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        chosen = [params[i] for i in rows]
        x = logits[rows] / torch.tensor([p.temperature for p in chosen], device=logits.device).unsqueeze(-1)
        x = apply_top_p(apply_top_k(x, [p.top_k for p in chosen]), [p.top_p for p in chosen])
        tokens[rows] = _inverse_cdf(x.softmax(dim=-1), [generators[i] for i in rows])
    return tokens.tolist()


def _inverse_cdf(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One index per row drawn from the row's distribution: the first whose cumulative mass exceeds u * total."""
    # Seeded rows draw from their own (CPU) generator, so a seed gives the same draw whatever the batch or device.
    shared = torch.rand(len(generators))
    u = torch.stack([torch.rand((), generator=g) if g is not None else shared[i] for i, g in enumerate(generators)])
    cdf = probs.cumsum(dim=-1)
    target = (u.to(probs.device, probs.dtype) * cdf[:, -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # zero-probability tokens are never chosen
    # Rounding can put the target at the very end of the row: fall back to the last token with mass.
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(index, last)
