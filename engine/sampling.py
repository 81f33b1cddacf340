"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""
from __future__ import annotations

import torch

from engine.config import SamplingParams


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of a row (ties at the k-th value survive); the rest become -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability mass reaches p (always at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits [N, V] (fp32)."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        row = apply_top_p(apply_top_k(row, p.top_k), p.top_p)
        probs = row.softmax(dim=-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return tokens
