"""What the engine hands out: per-step deltas, finished results, and one record per step."""
from __future__ import annotations

from dataclasses import KW_ONLY, asdict, dataclass, field

from engine.request import FinishReason
from engine.step_time import PRICES, RERANK_KINDS, TokenKind


# Per position: token id -> log-probability, holding the chosen (or prompt) token and the top-k alternatives.
Logprobs = dict[int, float]


@dataclass(slots=True)
class StepOutput:
    """What a request hands out in one step; the base of the three kinds' outputs (the type says which):
    `TokenDelta` (a generation's progress), `RerankOutput` (a rerank job's scores), `EmbedOutput` (an embedding job's
    vectors). Its fields are what every kind has: how it ended, its usage and its timing."""
    request_id: str
    _: KW_ONLY
    finished: bool = False  # the request's last output
    finish_reason: FinishReason | None = None
    error: str | None = None  # set with finish_reason "error"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    arrival_time: float = 0.0  # time.monotonic() when the engine accepted the request
    queue_time_s: float | None = None  # arrival until it first rode in a step


@dataclass(slots=True)
class TokenDelta(StepOutput):
    """New tokens/text of one completion (`index`) of a generation.

    With n > 1 a request streams n completions; `finish_reason` is set on the output where a completion ends, and
    `finished` only on the request's last output (every completion done, or the request aborted / failed)."""
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""  # text delta, never a broken UTF-8 sequence or a partial stop string
    index: int = 0  # which completion (0..n-1) the tokens belong to
    logprobs: list[Logprobs] | None = None  # one per new token, with SamplingParams.logprobs set
    # With SamplingParams.prompt_logprobs: on the first output of the request only, one per prompt token (None for
    # the first, which nothing predicts).
    prompt_logprobs: list[Logprobs | None] | None = None
    completion_tokens: int = 0
    first_token_time: float | None = None  # time.monotonic() of the first generated token


@dataclass(slots=True)
class RerankOutput(StepOutput):
    """A rerank job's one output, when it ends; the lists are set when it finished with "stop", else None."""
    scores: list[float] | None = None  # one per document, input order
    document_tokens: list[int] | None = None  # per document, its tokens the score saw
    truncated: list[bool] | None = None  # per document, whether it was cut to fit the limit
    windows: list[int] | None = None  # per document, the windows it was scored as (its score the best of theirs)
    # documents scored by the embedder's cosine alone, no LLM or cross-encoder pair (dense; a cascade's below its top
    # k): the pairs step records never count (StepRecord.rerank_pairs_scored counts those a forward scored)
    embedder_scored: int = 0


@dataclass(slots=True)
class EmbedOutput(StepOutput):
    """An embedding job's one output, when it ends; the lists are set when it finished with "stop", else None."""
    embeddings: list[list[float]] | None = None  # one vector per input, input order
    truncated: list[bool] | None = None  # per input, whether it was cut to the embedder's limit


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n completions."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[Logprobs] | None = None  # one per token, with SamplingParams.logprobs set


@dataclass(slots=True)
class RequestOutput:
    """A finished generation, as `LLM.generate` returns it. text / token_ids / finish_reason / logprobs are those
    of the first completion; `outputs` holds all n (as in vLLM, also for n = 1)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    cached_tokens: int = 0
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)


@dataclass(slots=True)
class RerankResult:
    """One document of a ranked rerank answer, as `LLM.rerank(..., ranked=True)` and the service return it."""
    index: int  # position in the request's documents
    score: float
    document: str | None = None  # with return_documents
    document_tokens: int = 0  # the document's tokens the score saw
    truncated: bool = False  # the document was cut at its end to fit the rerank pair limit (truncate="end")
    windows: int = 1  # overlapping windows the document was scored as, its score the best of theirs (max_windows)


def check_top_n(top_n: int | None) -> None:
    """ValueError unless `top_n` is None (every document) or an integer >= 1."""
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise ValueError(f"top_n must be >= 1, got {top_n!r}")


def rank_scores(scores: list[float], documents: list[str], top_n: int | None, return_documents: bool,
                document_tokens: list[int] | None = None, truncated: list[bool] | None = None,
                windows: list[int] | None = None) -> list[RerankResult]:
    """Highest score first (ties keep input order), at most top_n."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_n]
    return [RerankResult(i, scores[i], documents[i] if return_documents else None,
                         document_tokens[i] if document_tokens else 0, bool(truncated and truncated[i]),
                         windows[i] if windows else 1)
            for i in order]


@dataclass(slots=True)
class StepRecord:
    """What one engine step did; the service turns it into a span and metrics."""
    step: int
    start_time: float  # time.monotonic()
    duration_s: float
    decode_tokens: int
    cached_tokens: int  # prompt tokens newly admitted from the prefix cache this step
    num_seqs: int
    budget: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    preempted: int
    num_running: int  # sequences holding KV after the step (rerank pairs excluded once scored)
    num_waiting: int
    request_ids: list[str]  # every request (generation or rerank job) this step served
    # Per kind of work (engine/step_time.py TokenKind): the tokens the step computed (of a row that ran k of its N
    # stages, k / N of its tokens), the rows that rode in it, and of those the ones whose last chunk or stage ran
    # (scored, embedded); decodes apart (decode_tokens). The Batch's counts, as the step ran them.
    tokens: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)
    rows_done: dict = field(default_factory=dict)
    decode_request_ids: list[str] = field(default_factory=list)
    forward_s: float = 0.0  # part of duration_s spent in model forwards; the rest is engine overhead
    decode_context_tokens: int = 0  # context the decode rows attended to (their sequence lengths, summed)
    predicted_s: float | None = None  # the admission policy's step-time prediction (None: it has no model)
    target_s: float | None = None  # the step time the policy keeps decodes under (--tpot-target-ms)
    limit_s: float | None = None  # the predicted step time it planned admissions under (target less its margins)
    planned: bool = False  # the objective sized admissions beside decodes, within the target
    owed: tuple = ()  # per kind of work that waited: the share of this step it was owed (engine/batch.py Owed)
    cpu_kernels: str = ""  # the CPU path of the quantized matmuls ("avx512", "avx2", "portable"; "" when none)

    @property
    def prediction_error(self) -> float | None:
        """(actual - predicted) / actual: the share of the step's time the model missed (> 0: ran longer)."""
        if self.predicted_s is None or self.duration_s <= 0:
            return None
        return (self.duration_s - self.predicted_s) / self.duration_s

    @property
    def budget_used(self) -> int:
        return self.decode_tokens + sum(self.tokens.values())

    def tokens_by_request(self) -> dict[str, int]:
        """The step's tokens per kind of request its rows belong to (a generation's as "prefill", then "rerank",
        "embed"; decodes apart): the parts of the service's step-tokens metric."""
        out: dict[str, int] = {}
        for kind, n in self.tokens.items():
            request = PRICES[kind].request
            name = "prefill" if request.samples else request.value
            out[name] = out.get(name, 0) + n
        return out

    def flat(self) -> dict:
        """The record as one flat dict (`tandem serve --step-log`'s JSON line): its fields, the per-kind maps as the
        counts named below."""
        out = asdict(self)  # nested dataclasses (owed) as dicts too, as JSON takes them
        for name in ("tokens", "rows", "rows_done"):
            del out[name]
        return {**out, **{name: getattr(self, name) for name in COUNT_NAMES}}

    # The per-kind counts by their names (spans, metrics, the step log and the benchmarks read these).
    prefill_tokens = property(lambda self: self.tokens.get(TokenKind.PREFILL, 0))
    rerank_pairs = property(lambda self: sum(self.rows.get(k, 0) for k in RERANK_KINDS))
    rerank_tokens = property(lambda self: sum(self.tokens.get(k, 0) for k in RERANK_KINDS))
    cross_encoder_tokens = property(lambda self: self.tokens.get(TokenKind.CROSS_ENCODER, 0))  # of rerank_tokens
    rerank_pairs_scored = property(lambda self: sum(self.rows_done.get(k, 0) for k in RERANK_KINDS))  # scored
    embed_rows = property(lambda self: self.rows.get(TokenKind.EMBED, 0))  # whole or some of their stages
    embed_tokens = property(lambda self: self.tokens.get(TokenKind.EMBED, 0))
    embed_rows_done = property(lambda self: self.rows_done.get(TokenKind.EMBED, 0))  # their vectors are done


COUNT_NAMES = ("prefill_tokens", "rerank_pairs", "rerank_tokens", "cross_encoder_tokens", "rerank_pairs_scored",
               "embed_rows", "embed_tokens", "embed_rows_done")
