"""Token sampling: logits processors, greedy, temperature, min-p, top-k, top-p, per-request seeds, and the raw
log-probabilities of the chosen tokens, for all rows of a step at once.

Each sampled row draws one uniform number and inverts its cumulative distribution (a cumsum and a searchsorted).
Rows with top-k or top-p draw among candidates: the row's most likely tokens, 256 first and more only when a
nucleus is wider. On CPU torch.multinomial and a full-vocabulary sort each took ~35 ms per row, so a step of 128
sampled sequences spent seconds here; this way it is one softmax, one top-k and small cumsums.

Order (vLLM v1's): the logits processors (engine/logits_processors.py: min_tokens, logit_bias, structured mask,
penalties), then temperature, min_p, top_k, top_p. Log-probabilities are of the raw logits, before any of it.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import SamplingParams
from engine.logits_processors import SamplingContext, apply_processors

if TYPE_CHECKING:
    from engine.request import Sequence

FIRST_CANDIDATES = 256


@dataclass(slots=True)
class Sampled:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]  # per row: the chosen token and top alternatives, if params.logprobs


def sample_sequences(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int]) -> Sampled:
    """The next token of each sequence (one row of logits [N, V] each, overwritten by the processors) and, for
    those that ask, its raw log-probability with the top params.logprobs alternatives."""
    params = [s.params for s in seqs]
    wanted = [j for j, p in enumerate(params) if p.logprobs is not None]
    raw = _take(logits, wanted).log_softmax(dim=-1) if wanted else None  # before the processors write
    tokens = sample(logits, params, [s.generator for s in seqs], SamplingContext.of(seqs, eos_token_ids))
    logprobs: list[dict[int, float] | None] = [None] * len(seqs)
    if wanted:
        tops = top_logprobs(raw, [tokens[j] for j in wanted], [params[j].logprobs for j in wanted])
        for j, top in zip(wanted, tops):
            logprobs[j] = top
    return Sampled(tokens=tokens, logprobs=logprobs)


def top_logprobs(logprobs: torch.Tensor, chosen: list[int], ks: list[int]) -> list[dict[int, float]]:
    """Per row of logprobs [R, V]: {chosen token: its log-probability} plus the row's k most likely tokens."""
    index = torch.tensor(chosen, dtype=torch.int64, device=logprobs.device).unsqueeze(-1)
    picked = logprobs.gather(-1, index).squeeze(-1).tolist()
    width = max(ks, default=0)
    values, ids = logprobs.topk(width, dim=-1) if width else (None, None)
    values, ids = (values.tolist(), ids.tolist()) if width else ([[]] * len(ks), [[]] * len(ks))
    out = []
    for token, value, k, row_ids, row_values in zip(chosen, picked, ks, ids, values):
        out.append({token: value, **dict(zip(row_ids[:k], row_values[:k]))})
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           context: SamplingContext | None = None) -> list[int]:
    """One token per row of logits [N, V] (fp32). Rows that set a logits processor are processed in place first;
    min_tokens and the penalties need the context (each row's tokens, the EOS ids)."""
    apply_processors(logits, params, context)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return logits.argmax(dim=-1).tolist()
    greedy = [i for i, p in enumerate(params) if p.greedy]
    tokens = torch.empty(len(params), dtype=torch.int64, device=logits.device)
    if greedy:  # argmax of a [128, 49152] block costs as much as its softmax on CPU: only where it is the answer
        tokens[greedy] = _take(logits, greedy).argmax(dim=-1)
    chosen = [params[i] for i in rows]
    vocab = logits.shape[-1]
    probs = _min_p(_scaled(_take(logits, rows), [p.temperature for p in chosen]).softmax(dim=-1),
                   [p.min_p for p in chosen])
    u = _uniforms([generators[i] for i in rows]).to(probs.device)
    narrowed = [0 < p.top_k < vocab or p.top_p < 1.0 for p in chosen]
    filtered = [j for j, n in enumerate(narrowed) if n]
    plain = [j for j, n in enumerate(narrowed) if not n]
    picked = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
    if plain:
        picked[plain] = _inverse_cdf(_take(probs, plain), u[plain])
    if filtered:
        picked[filtered] = _sample_candidates(_take(probs, filtered), [chosen[j].top_k for j in filtered],
                                              [chosen[j].top_p for j in filtered], u[filtered])
    tokens[rows] = picked
    return tokens.tolist()


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return t if len(rows) == t.shape[0] else t[rows]


def _scaled(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """logits / temperature per row; no pass over the block when every row is at 1 (x / 1 is x exactly)."""
    if all(t == 1.0 for t in temperatures):
        return logits
    return logits / torch.tensor(temperatures, device=logits.device).unsqueeze(-1)


def _min_p(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Zero the tokens less likely than min_p times the row's most likely one (transformers' MinPLogitsWarper) and
    renormalise, so top-p then measures the mass of what is left, as in vLLM."""
    rows = [j for j, m in enumerate(min_p) if m > 0.0]
    if not rows:
        return probs
    kept = _take(probs, rows)
    floor = kept.amax(dim=-1, keepdim=True) * torch.tensor([min_p[j] for j in rows], device=probs.device)[:, None]
    kept = kept.masked_fill(kept < floor, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    if len(rows) == probs.shape[0]:
        return kept
    probs[rows] = kept
    return probs


def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One U[0, 1) per row. A seeded row draws from its own (CPU) generator, so its draws do not depend on the
    batch around it or on the device."""
    shared = torch.rand(len(generators))
    return torch.stack([torch.rand((), generator=g) if g is not None else shared[i] for i, g in enumerate(generators)])


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass exceeds u * total (zero-probability tokens are never it)."""
    cdf = probs.cumsum(dim=-1)
    index = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).clamp(max=probs.shape[-1] - 1)
    # u * total can round up to total (p ~ 1e-7): then the clamp may land on a zero-mass tail; take the mode.
    hit_zero = probs.gather(-1, index) == 0
    return torch.where(hit_zero, probs.argmax(dim=-1, keepdim=True), index).squeeze(-1)


def candidate_mask(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted candidate probabilities with the dropped ones zeroed, their token ids), both [N, width].

    Top-k keeps the k most likely tokens; top-p then keeps the smallest prefix of those whose renormalised mass
    reaches p (always at least one token), as vLLM applies them. Only the rows whose nucleus is wider than the
    first search look further, so one flat row does not widen the work of the whole batch."""
    vocab = probs.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    k_col = torch.tensor(ks, device=probs.device).unsqueeze(-1)
    p_col = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], device=probs.device).unsqueeze(-1)
    width = min(vocab, max([FIRST_CANDIDATES] + [k for k in ks if k < vocab]))
    values, ids, unfinished = _candidates(probs, k_col, p_col, width)
    while width < vocab and bool(unfinished.any()):
        width = min(vocab, width * 8)
        rows = unfinished.nonzero().squeeze(-1)
        wider_values, wider_ids, still = _candidates(probs[rows], k_col[rows], p_col[rows], width)
        values = torch.nn.functional.pad(values, (0, width - values.shape[-1]))
        ids = torch.nn.functional.pad(ids, (0, width - ids.shape[-1]))
        values[rows], ids[rows] = wider_values, wider_ids
        unfinished = torch.zeros_like(unfinished)
        unfinished[rows] = still
    return values, ids


def _candidates(probs: torch.Tensor, k_col: torch.Tensor, p_col: torch.Tensor,
                width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """candidate_mask among each row's `width` most likely tokens, and which rows' nuclei may reach further."""
    values, ids = torch.topk(probs, width, dim=-1)  # descending: a prefix of the fully sorted row
    position = torch.arange(width, device=probs.device)
    values = values.masked_fill(position >= k_col, 0.0)
    mass = torch.where(k_col < probs.shape[-1], values.sum(dim=-1, keepdim=True), torch.ones_like(values[:, :1]))
    keep = ((values.cumsum(dim=-1) - values) < p_col * mass) & (position < k_col)
    # A row's nucleus is complete when its last candidate is dropped (or there are no more tokens to look at).
    unfinished = keep[:, -1] if width < probs.shape[-1] else torch.zeros_like(keep[:, -1])
    return values.masked_fill(~keep, 0.0), ids, unfinished


def _sample_candidates(probs: torch.Tensor, top_k: list[int], top_p: list[float], u: torch.Tensor) -> torch.Tensor:
    values, ids = candidate_mask(probs, top_k, top_p)
    cdf = values.cumsum(dim=-1)
    last_kept = (values > 0).sum(dim=-1, keepdim=True).clamp(min=1) - 1  # kept candidates are a prefix
    position = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True)
    return ids.gather(-1, torch.minimum(position, last_kept)).squeeze(-1)
