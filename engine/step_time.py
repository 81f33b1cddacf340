"""How long a step will take, predicted from what is in it: the model a latency objective plans against.

A step's time is linear in its composition (`StepShape`): a fixed cost for running the LLM forward at all, per decode
row, per token of context those rows attend to, per prompt token, per LLM-scored rerank token, and, for a
cross-encoder, a fixed cost for its own forward plus per pair token. `LinearStepTime` holds fixed coefficients (the
fake tests inject); `OnlineStepTime` fits them from the engine's own steps:

* Least squares over a sliding window of the last `window` steps, each weighted by 1 / predicted time^2, so it fits
  relative error (a 5 ms decode step counts as much as a 500 ms prefill step).
* Robust: Huber weights on the relative residuals with a MAD scale (IRLS, a few passes per fit), so a step that ran
  10x long because the machine was busy gets a weight near zero instead of pulling every coefficient up. Only when
  slow steps become the majority of the window (the machine really is slower now) does the fit follow them.
* A ridge toward the previous coefficients, worth `prior_steps` steps, keeps directions the window says nothing
  about (no cross-encoder tokens seen yet; decode rows always 16) where they were, and coefficients are >= 0.
* The first coefficients are a device-agnostic prior, deliberately slow (2 ms a token, 10 ms a forward). `tandem
  serve` replaces them before the first request: engine/calibrate.py runs a short sweep of real step shapes on this
  machine (or reads the fit it cached for this model, host, threads and CPU path) and `seed`s the model with it.
  An engine that was not calibrated learns from its first steps: until `min_samples` of them `ready` is False and
  the objective plans as plain budget filling (its fallback).

Fitting is lazy (on the first predict after new steps), so its cost lands inside a step's measured time.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from engine.request import RowExec, SeqKind, Sequence

FEATURES = ("llm_forward", "decode_rows", "decode_context_tokens", "prefill_tokens", "llm_rerank_tokens",
            "cross_encoder_forward", "cross_encoder_tokens", "wide_forward", "embed_forward", "embed_tokens")


class TokenKind(str, enum.Enum):
    """A kind of token a policy admits; its value names the FEATURE (coefficient) one such token costs."""
    PREFILL = "prefill_tokens"
    LLM_RERANK = "llm_rerank_tokens"  # a rerank pair's token in the LLM forward (likelihood, judge)
    CROSS_ENCODER = "cross_encoder_tokens"  # a rerank pair's token in the cross-encoder's own forward
    EMBED = "embed_tokens"  # an embedding input's token in the embedder's own forward

    # Hashed as its value, in C (Enum's own __hash__ is a Python call): the per-kind maps of Batch, StepShape and
    # StepRecord are read on every row of every step.
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


@dataclass(frozen=True, slots=True)
class Price:
    """How the step-time model prices one kind of token: its coefficient is the FEATURE its TokenKind names; it
    runs in the LLM's forward (with the decodes and prompts: one fixed `llm_forward`, the narrow path's rows) or in
    an encoder's own forward, whose fixed cost (`forward`, a FEATURE) its first token brings. `request`: the kind of
    request whose rows these tokens are."""
    request: SeqKind
    forward: str = "llm_forward"

    @property
    def in_llm(self) -> bool:
        return self.forward == "llm_forward"


# The one table of how each kind of token is priced (a new TokenKind is a new FEATURE pair and a row here).
PRICES: dict[TokenKind, Price] = {
    TokenKind.PREFILL: Price(SeqKind.GENERATE),
    TokenKind.LLM_RERANK: Price(SeqKind.RERANK),
    TokenKind.CROSS_ENCODER: Price(SeqKind.RERANK, "cross_encoder_forward"),
    TokenKind.EMBED: Price(SeqKind.EMBED, "embed_forward"),
}
# The token kinds of a rerank's pairs (the step records' rerank_* counts sum them)
RERANK_KINDS = tuple(k for k, p in PRICES.items() if p.request == SeqKind.RERANK)
_LLM_KINDS = tuple(k for k, p in PRICES.items() if p.in_llm)
# Per token kind, for features(): (its feature's index, its forward's index, whether it runs in the LLM forward)
_SLOTS = {k: (FEATURES.index(k.value), FEATURES.index(p.forward), p.in_llm) for k, p in PRICES.items()}
_WIDE = FEATURES.index("wide_forward")


def work_kind(seq: Sequence) -> TokenKind:
    """The kind of work a row is, as the planner prices it: its request's kind and how it runs (RowExec)."""
    if seq.kind is SeqKind.GENERATE:
        return TokenKind.PREFILL
    if seq.kind is SeqKind.EMBED:
        return TokenKind.EMBED
    return TokenKind.LLM_RERANK if seq.execution is RowExec.CAUSAL else TokenKind.CROSS_ENCODER


class StepShape:
    """What a step computes, as far as its time goes: its decode rows, the context they attend to, and per kind of
    token (TokenKind) how many it computes (`tokens`; a kind may be given by its FEATURE name as a keyword:
    `StepShape(decode_rows=4, embed_tokens=12)`)."""
    __slots__ = ("decode_rows", "decode_context_tokens", "tokens")

    def __init__(self, decode_rows: int = 0, decode_context_tokens: int = 0,
                 tokens: "dict[TokenKind, int] | None" = None, **per_kind: int) -> None:
        self.decode_rows = decode_rows
        self.decode_context_tokens = decode_context_tokens  # sum over decode rows of the context each attends to
        self.tokens: dict[TokenKind, int] = dict(tokens) if tokens else {}
        for name, n in per_kind.items():
            if n:
                kind = TokenKind(name)
                self.tokens[kind] = self.tokens.get(kind, 0) + n

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepShape):
            return NotImplemented
        return (self.decode_rows, self.decode_context_tokens, {k: n for k, n in self.tokens.items() if n}) == \
            (other.decode_rows, other.decode_context_tokens, {k: n for k, n in other.tokens.items() if n})

    def __repr__(self) -> str:
        kinds = "".join(f", {k.value}={n}" for k, n in self.tokens.items() if n)
        return f"StepShape(decode_rows={self.decode_rows}, decode_context_tokens={self.decode_context_tokens}{kinds})"

    def of(self, kind: TokenKind) -> int:
        """Tokens of `kind` in the step."""
        return self.tokens.get(kind, 0)

    def add(self, kind: TokenKind, n: int) -> None:
        self.tokens[kind] = self.tokens.get(kind, 0) + n

    def with_tokens(self, kind: TokenKind, n: int) -> "StepShape":
        """This shape with `n` more tokens of `kind` (a new shape)."""
        tokens = dict(self.tokens)
        tokens[kind] = tokens.get(kind, 0) + n
        return StepShape(self.decode_rows, self.decode_context_tokens, tokens)

    # The kinds by their FEATURE names, read-only (what the tests and the benchmarks read).
    prefill_tokens = property(lambda self: self.tokens.get(TokenKind.PREFILL, 0))
    llm_rerank_tokens = property(lambda self: self.tokens.get(TokenKind.LLM_RERANK, 0))
    cross_encoder_tokens = property(lambda self: self.tokens.get(TokenKind.CROSS_ENCODER, 0))
    embed_tokens = property(lambda self: self.tokens.get(TokenKind.EMBED, 0))

    @classmethod
    def of_batch(cls, batch) -> "StepShape":
        return cls(batch.num_decode_tokens, batch.num_decode_context_tokens, batch.tokens)

    @classmethod
    def of_rows(cls, rows: "list[Sequence]") -> "StepShape":
        """A job's rows as one step, as if it ran alone: each row's tokens as its kind of work (a completion that
        forks another's prompt adds nothing)."""
        shape = cls()
        for seq in rows:
            if seq.fork_of is None:
                shape.add(work_kind(seq), seq.num_tokens)
        return shape

    @classmethod
    def of_record(cls, r) -> "StepShape":
        return cls(r.decode_tokens, r.decode_context_tokens, r.tokens)

    @property
    def empty(self) -> bool:
        return not (self.decode_rows or any(self.tokens.values()))

    @property
    def llm_rows(self) -> int:
        return self.decode_rows + sum(self.tokens.get(k, 0) for k in _LLM_KINDS)

    def features(self, wide_rows: int | None = None) -> tuple[float, ...]:
        """`wide_rows`: above this many LLM rows the forward takes another path with a fixed cost of its own (the
        quantized CPU matmul dequantizes every weight once a step has more than kernels.quant.small_m rows)."""
        x = [0.0] * len(FEATURES)
        x[1], x[2] = self.decode_rows, self.decode_context_tokens  # decode_rows, decode_context_tokens
        llm_rows = self.decode_rows
        if llm_rows:
            x[0] = 1.0  # llm_forward
        for kind, n in self.tokens.items():
            if n:
                i, forward, in_llm = _SLOTS[kind]
                x[i] += n
                x[forward] = 1.0
                if in_llm:
                    llm_rows += n
        if wide_rows is not None and llm_rows > wide_rows:
            x[_WIDE] = 1.0
        return tuple(x)


# Seconds per unit of each feature: slow on purpose (conservative), replaced by the first real steps.
PRIOR = dict(llm_forward=0.010, decode_rows=0.002, decode_context_tokens=2e-6, prefill_tokens=0.002,
             llm_rerank_tokens=0.002, cross_encoder_forward=0.010, cross_encoder_tokens=0.001, wide_forward=0.0,
             embed_forward=0.010, embed_tokens=0.001)


class LinearStepTime:
    """Fixed coefficients (seconds per unit of each FEATURE): the step-time model tests inject, and the base of the
    fitted one. `ready` and `margin` are what a policy asks before trusting it."""

    def __init__(self, coef: dict[str, float] | None = None, wide_rows: int | None = None) -> None:
        self.wide_rows = wide_rows  # LLM rows above which a step pays `wide_forward` (None: no such threshold)
        coef = {**PRIOR, **(coef or {})}
        unknown = set(coef) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown step-time features {sorted(unknown)}; known: {', '.join(FEATURES)}")
        self.coef = [float(coef[name]) for name in FEATURES]

    @property
    def ready(self) -> bool:
        return True

    def margin(self) -> float:
        """Relative headroom to plan with: a policy keeps predict(shape) * (1 + margin) under its target."""
        return 0.0

    def coefficients(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.coef))

    def predict(self, shape: StepShape) -> float:
        if shape.empty:
            return 0.0
        return sum(c * x for c, x in zip(self.coef, shape.features(self.wide_rows)))

    @staticmethod
    def predict_with(coef: dict[str, float], shape: StepShape, wide_rows: int | None = None) -> float:
        """What coefficients `coef` predict for `shape`."""
        return LinearStepTime(coef, wide_rows).predict(shape)

    def token_cost_s(self, kind: TokenKind) -> float:
        """Seconds one more token of `kind` adds to a step that already runs its forward."""
        return self.coef[FEATURES.index(kind)]

    def tokens_within(self, shape: StepShape, kind: TokenKind, limit_s: float) -> int:
        """The most tokens of `kind` that `shape` can take with its predicted time still <= limit_s (0 when it is
        over already)."""
        i = FEATURES.index(kind)
        price = PRICES[kind]
        running = shape.llm_rows if price.in_llm else shape.of(kind)  # the forward it shares is paid already
        fixed = 0.0 if running else self.coef[FEATURES.index(price.forward)]
        room = limit_s - self.predict(shape) - fixed
        if room < 0:
            return 0
        per_token = self.coef[i]
        n = int(room / per_token) if per_token > 0 else 1 << 30
        narrow = self.narrow_room(shape, kind)
        if narrow is None or n <= narrow:
            return n
        room -= self.coef[FEATURES.index("wide_forward")]  # crossing the threshold costs its fixed part
        wide = (int(room / per_token) if per_token > 0 else 1 << 30) if room >= 0 else 0
        return wide if wide > narrow else narrow

    def narrow_room(self, shape: StepShape, kind: TokenKind) -> int | None:
        """Tokens of `kind` that `shape` can take and stay on the narrow path (None: `kind` does not run in the LLM
        forward, the model knows no threshold, or the step is wide already)."""
        if self.wide_rows is None or not PRICES[kind].in_llm or shape.llm_rows > self.wide_rows:
            return None
        return self.wide_rows - shape.llm_rows

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A step of this shape took `seconds` (a fixed model ignores it)."""


class OnlineStepTime(LinearStepTime):
    """Coefficients fitted online, robustly, over the last `window` steps (see the module docstring)."""

    def __init__(self, window: int = 256, min_samples: int = 8, prior_steps: float = 2.0, huber_k: float = 2.0,
                 quantile_z: float = 1.28, max_margin: float = 0.5, refit_every: int = 4,
                 prior: dict[str, float] | None = None, wide_rows: int | None = None) -> None:
        super().__init__(prior, wide_rows)
        self.window = window
        self.min_samples = min_samples
        self.prior_steps = prior_steps
        self.huber_k = huber_k
        self.quantile_z = quantile_z  # margin = z x the robust spread of relative errors (1.28: about p90)
        self.max_margin = max_margin
        self.refit_every = refit_every
        self._x = np.zeros((window, len(FEATURES)))  # ring buffers of the last `window` steps
        self._y = np.zeros(window)
        self._seen = 0
        self._fitted_at = 0  # _seen at the last fit
        self._spread = 0.0  # robust (MAD) standard deviation of relative residuals at the last fit
        self._seeded = False  # seeded from a calibration: ready before min_samples steps
        self.num_fits = 0

    @property
    def ready(self) -> bool:
        return self._seeded or self._seen >= self.min_samples

    def seed(self, coef: dict[str, float], spread: float) -> None:
        """Start from a calibrated fit (engine/calibrate.py): these coefficients, this spread of relative errors, and
        ready at once; the online fit then refines them (ridging toward them where its window says little)."""
        unknown = set(coef) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown step-time features {sorted(unknown)}")
        self.coef = [float(coef.get(name, c)) for name, c in zip(FEATURES, self.coef)]
        self._spread = max(0.0, float(spread))
        self._seeded = True
        self._fitted_at = self._seen  # the window so far is what the seed was fitted on

    def spread(self) -> float:
        """The robust spread (MAD standard deviation) of the fit's relative errors."""
        self._refit()
        return self._spread

    def observe(self, shape: StepShape, seconds: float) -> None:
        if shape.empty or not seconds > 0 or not math.isfinite(seconds):
            return
        i = self._seen % self.window
        self._x[i] = shape.features(self.wide_rows)
        self._y[i] = seconds
        self._seen += 1

    def fit_errors(self) -> dict[str, tuple[int, float]]:
        """Per kind of work, over the window's steps that carried it: (steps, median relative error of the current
        fit on them); "decodes" for the steps of decodes alone. Where a kind's error stays high, the fit prices it
        wrongly (the mixed steps that carry it are what it is fitted on)."""
        self._refit()
        n = min(self._seen, self.window)
        x, y = self._x[:n], self._y[:n]
        rel = np.abs(y - x @ np.asarray(self.coef)) / np.maximum(y, 1e-9)
        columns = {kind.value: x[:, FEATURES.index(kind.value)] > 0 for kind in TokenKind}
        others = np.any(np.stack(list(columns.values())), axis=0) if n else np.zeros(0, dtype=bool)
        columns["decodes"] = (x[:, FEATURES.index("decode_rows")] > 0) & ~others
        return {name: (int(mask.sum()), float(np.median(rel[mask]))) for name, mask in columns.items() if mask.any()}

    def margin(self) -> float:
        self._refit()
        return min(self.max_margin, self.quantile_z * self._spread)

    def predict(self, shape: StepShape) -> float:
        self._refit()
        return LinearStepTime.predict(self, shape)

    def tokens_within(self, shape: StepShape, kind: TokenKind, limit_s: float) -> int:
        self._refit()
        return LinearStepTime.tokens_within(self, shape, kind, limit_s)

    def _refit(self) -> None:
        new = self._seen - self._fitted_at
        # Every `refit_every` steps (each fit costs ~0.2 ms), and at once while the model is young.
        if not new or (new < self.refit_every and (self._fitted_at >= self.min_samples or self._seeded)):
            return
        self._fitted_at = self._seen
        self.num_fits += 1
        n = min(self._seen, self.window)
        x, y = self._x[:n], self._y[:n]
        prev = np.asarray(self.coef)
        theta = prev
        active = np.ones(len(prev), dtype=bool)
        for _ in range(2):  # IRLS: relative residuals, Huber weights with a MAD scale
            pred = np.maximum(x @ theta, 1e-6)
            rel = (y - pred) / pred
            spread = max(1.4826 * float(np.median(np.abs(rel - np.median(rel)))), 0.01)
            abs_rel = np.abs(rel)
            w = np.where(abs_rel <= self.huber_k * spread, 1.0, self.huber_k * spread / np.maximum(abs_rel, 1e-12))
            w = w / pred ** 2
            # Ridge toward the previous coefficients, worth `prior_steps` average steps of the window per feature
            # (a tiny floor pins the features the window never saw where they were).
            scale = (x * x * (1.0 / pred ** 2)[:, None]).mean(axis=0)
            ridge = self.prior_steps * np.maximum(scale, 1e-9 * max(float(scale.max()), 1e-12))
            theta = self._solve(x, y, w, ridge, prev, active)
        self.coef = [float(c) for c in theta]
        pred = np.maximum(x @ theta, 1e-6)
        rel = (y - pred) / pred
        self._spread = 1.4826 * float(np.median(np.abs(rel - np.median(rel))))

    @staticmethod
    def _solve(x, y, w, ridge, prev, active) -> np.ndarray:
        """Weighted ridge least squares toward `prev`; coefficients that come out negative are held at 0 and the
        rest refitted (a step never gets faster by adding work)."""
        theta = prev.copy()
        for _ in range(len(prev)):
            idx = np.flatnonzero(active)
            xa = x[:, idx]
            a = (xa * w[:, None]).T @ xa + np.diag(ridge[idx])
            b = (xa * w[:, None]).T @ y + ridge[idx] * prev[idx]
            try:
                sol = np.linalg.solve(a, b)
            except np.linalg.LinAlgError:
                return prev
            theta = np.zeros_like(prev)
            theta[idx] = sol
            negative = idx[sol < 0]
            if not len(negative):
                return theta
            active[negative] = False
        return np.maximum(theta, 0.0)
