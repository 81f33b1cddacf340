"""The sampler's logits processors, in vLLM v1's order: min_tokens, logit_bias, the structured-output mask, then the
repetition, frequency and presence penalties. Each runs batched over the rows that set it, in place.

Every processor writes only the (row, token) positions it changes, found from the rows' params and tokens (no
Python loop over the vocabulary, no dense [rows, vocab] temporary): a row that sets nothing keeps its logits bit
for bit, and the penalties of 128 rows cost one sort of their tokens (torch.unique's counts) and a few gathers.
"""
from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import SamplingParams

if TYPE_CHECKING:
    from engine.request import Sequence


@dataclass(slots=True)
class SamplingContext:
    """What the processors read besides each row's params: its tokens so far and grammar, and the model's EOS ids."""
    token_ids: list[list[int]]  # per row: prompt followed by the tokens generated so far
    num_prompt_tokens: list[int]
    eos_token_ids: frozenset[int] = frozenset()
    grammars: list | None = None  # per row: a GrammarMatcher (engine/structured.py) or None

    @classmethod
    def of(cls, seqs: list[Sequence], eos_token_ids: Collection[int]) -> SamplingContext:
        return cls(token_ids=[s.token_ids for s in seqs], num_prompt_tokens=[s.num_prompt_tokens for s in seqs],
                   eos_token_ids=frozenset(eos_token_ids), grammars=[s.grammar for s in seqs])

    def num_output_tokens(self, row: int) -> int:
        return len(self.token_ids[row]) - self.num_prompt_tokens[row]


def apply_processors(logits: torch.Tensor, params: list[SamplingParams], context: SamplingContext | None) -> None:
    """Apply, in place on logits [N, V] (contiguous), every processor some row sets; other rows are not written."""
    if not logits.is_contiguous():
        raise ValueError("the logits processors write a contiguous [N, V] tensor in place")
    if context is None and any(p.min_tokens or p.has_penalties for p in params):
        raise ValueError("min_tokens and penalties need a SamplingContext (each row's tokens and the EOS ids)")
    _min_tokens(logits, params, context)
    _logit_bias(logits, params)
    _grammar_mask(logits, context)
    _penalties(logits, params, context)


def _min_tokens(logits: torch.Tensor, params: list[SamplingParams], context: SamplingContext | None) -> None:
    """-inf on EOS (unless ignore_eos) and stop_token_ids while a row has generated fewer than min_tokens."""
    rows, tokens = [], []
    vocab = logits.shape[-1]
    for r, p in enumerate(params):
        if p.min_tokens and context.num_output_tokens(r) < p.min_tokens:
            stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | context.eos_token_ids
            banned = [t for t in stops if t < vocab]
            rows += [r] * len(banned)
            tokens += banned
    if tokens:
        _write(logits, _positions(logits, rows, tokens), float("-inf"))


def _logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows, tokens, bias = [], [], []
    vocab = logits.shape[-1]
    for r, p in enumerate(params):
        for t, b in (p.logit_bias or {}).items():
            if t < vocab:  # intake rejects larger ids; a stray one must not fail the whole step
                rows.append(r)
                tokens.append(t)
                bias.append(b)
    if tokens:
        logits.view(-1).index_add_(0, _positions(logits, rows, tokens), _values(bias, logits))


def _grammar_mask(logits: torch.Tensor, context: SamplingContext | None) -> None:
    """-inf on the tokens each row's grammar does not allow next (xgrammar's bitmask layout)."""
    if context is None or context.grammars is None:
        return
    rows = [r for r, g in enumerate(context.grammars) if g is not None]
    if not rows:
        return
    from engine.structured import allocate_bitmask, apply_bitmask  # only engines that serve grammars load it

    bitmask = allocate_bitmask(len(rows), logits.shape[-1])
    for i, r in enumerate(rows):
        context.grammars[r].fill_bitmask(bitmask, i)
    bitmask = bitmask.to(logits.device)
    if len(rows) == logits.shape[0]:
        apply_bitmask(logits, bitmask)
        return
    masked = logits[rows]
    apply_bitmask(masked, bitmask)
    logits[rows] = masked


def _penalties(logits: torch.Tensor, params: list[SamplingParams], context: SamplingContext | None) -> None:
    """Repetition over prompt + generated tokens (transformers' RepetitionPenaltyLogitsProcessor, vLLM), then
    OpenAI's logit - count * frequency - (count > 0) * presence over the generated ones."""
    flat = logits.view(-1)
    rep = [r for r, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        where, _, which = _seen(logits, rep, [context.token_ids[r] for r in rep])
        penalty = _values([params[r].repetition_penalty for r in rep], logits).index_select(0, which)
        seen = flat.index_select(0, where)
        flat.index_copy_(0, where, torch.where(seen > 0, seen / penalty, seen * penalty))
    counted = [r for r, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    counted = [r for r in counted if context.num_output_tokens(r) > 0]
    if counted:
        outputs = [context.token_ids[r][context.num_prompt_tokens[r]:] for r in counted]
        where, counts, which = _seen(logits, counted, outputs)
        frequency = _values([params[r].frequency_penalty for r in counted], logits).index_select(0, which)
        presence = _values([params[r].presence_penalty for r in counted], logits).index_select(0, which)
        flat.index_copy_(0, where, flat.index_select(0, where) - counts.to(logits.dtype) * frequency - presence)


def _seen(logits: torch.Tensor, rows: list[int],
          token_lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of each row's tokens: their positions in the flattened logits, their
    occurrences, and their row's index in `rows` (to pick per-row parameters), each 1-D on the logits' device."""
    vocab = logits.shape[-1]
    lengths = torch.tensor([len(t) for t in token_lists])
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    which = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    keys, counts = torch.unique(which * vocab + tokens, return_counts=True)
    which = keys // vocab
    where = keys + (torch.tensor(rows) - torch.arange(len(rows))).index_select(0, which) * vocab  # key's row j -> logits row
    device = logits.device
    return where.to(device), counts.to(device), which.to(device)


def _positions(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> torch.Tensor:
    """Positions of (row, token) pairs in the flattened logits."""
    vocab = logits.shape[-1]
    return torch.tensor([r * vocab + t for r, t in zip(rows, tokens)], dtype=torch.int64, device=logits.device)


def _write(logits: torch.Tensor, positions: torch.Tensor, value: float) -> None:
    logits.view(-1).index_fill_(0, positions, value)


def _values(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)
