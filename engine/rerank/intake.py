"""A rerank's intake: its spec checked and tokenized into its job (one pair per document, or window; the embedder's
rows in the modes that embed), on any thread. Registered in engine/kinds.py; reads the engine's fixed parts through
the RequestIntake it is given."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.config import EmbedParams, RerankParams
from engine.embed.intake import embed_sequences
from engine.errors import InputTooLong
from engine.rerank.job import RerankJob
from engine.rerank.pairs import covered, split_windows
from engine.rerank.scorer import PairPhase
from engine.request import RerankPair, RowExec, SeqKind, Sequence
from engine.specs import RerankSpec

if TYPE_CHECKING:
    from engine.intake import RequestIntake


def build(intake: "RequestIntake", spec: RerankSpec) -> RerankJob:
    """A job with one prefill-only pair sequence per document."""
    request_id, query, documents = spec.request_id, spec.query, spec.documents
    params = spec.params if spec.params is not None else RerankParams()
    if not isinstance(params, RerankParams):
        raise ValueError("params must be a RerankParams")
    if not isinstance(query, str) or not query.strip():
        raise ValueError("query must be a non-empty string")
    if not isinstance(documents, (list, tuple)) or not documents:
        raise ValueError("documents must be a non-empty list of strings")
    if len(documents) > intake.config.max_rerank_documents:
        raise ValueError(f"documents has {len(documents)} items; this server takes at most "
                         f"{intake.config.max_rerank_documents} per request (--max-documents, "
                         "EngineConfig.max_rerank_documents); split the request")
    if any(not isinstance(d, str) for d in documents):
        raise ValueError("documents must all be strings")
    job = RerankJob(request_id, query, list(documents), params, arrival_time=time.monotonic(),
                    scores=[None] * len(documents), span_logprobs=[[] for _ in documents],
                    windows=[1] * len(documents))
    scorer = intake.scorer
    windows = windows_of(intake, params)
    if scorer.pair_phase is not PairPhase.NEVER:
        # fusion and cascade: windows are the embedder's (its rows); their LLM pair reads the document whole (cut
        # at the context, as without windows), one pair per document
        _rerank_pairs(intake, job, 1 if scorer.embeds else windows)
    if scorer.embeds:
        _rerank_rows(intake, job, windows)
    return job

def windows_of(intake: "RequestIntake", params: RerankParams) -> int:
    """The most windows a document of this request may be scored as."""
    return params.max_windows if params.max_windows is not None else intake.config.rerank_max_windows



def _rerank_pairs(intake: "RequestIntake", job: RerankJob, max_windows: int = 1) -> None:
    """One prefill-only pair sequence per document (per window of a long one): queued now, or held until the
    embedder rows have run (PairPhase.AFTER_ROWS: the cascade queues the chosen ones, RerankJob.release)."""
    scorer, params = intake.scorer, job.params
    limit, limit_by = rerank_limit(intake, )
    pairs, shared = scorer.pairs(job.query, job.documents, params, limit, limit_by, max_windows,
                                 intake.config.rerank_window_overlap)
    firsts = [p for j, p in enumerate(pairs) if j == 0 or pairs[j - 1].document != p.document]
    job.document_tokens = [p.document_tokens for p in firsts]
    job.truncated = [p.truncated for p in firsts]
    job.windows = [p.windows for p in firsts]
    if len(pairs) != len(job.documents):  # windows: scores per pair, pooled per document when the job ends
        job.pair_units = [p.document for p in pairs]
        job.scores = [None] * len(pairs)
        job.span_logprobs = [[] for _ in pairs]
    # Later pairs wait for the first when it fills at least one full block of their shared prefix.
    wait = scorer.runs_on_llm and intake.config.enable_prefix_caching and shared >= intake.config.block_size
    at_once = scorer.pair_phase is PairPhase.AT_ONCE
    seqs = []
    for i, pair in enumerate(pairs):
        first = seqs[0] if seqs and wait and at_once else None
        seqs.append(Sequence(
            request_id=job.request_id, token_ids=pair.token_ids, num_prompt_tokens=len(pair.token_ids),
            params=params, arrival=next(intake.arrivals), arrival_time=job.arrival_time, kind=SeqKind.RERANK,
            priority=params.priority, execution=RowExec.CAUSAL if scorer.runs_on_llm else RowExec.ENCODER, logprob_start=pair.logprob_start,
            pair=RerankPair(i, wait_for=first, token_type_ids=pair.token_type_ids),
            stages=1 if scorer.runs_on_llm else scorer.stages))
    if at_once:
        job.pairs = seqs
        job.remaining += len(seqs)
    else:  # counted in `remaining` as release() queues the chosen ones
        job.held, job.wait_for_first = seqs, wait

def _rerank_rows(intake: "RequestIntake", job: RerankJob, max_windows: int = 1) -> None:
    """An embedding mode's rows: the query's, then each document's (cut to the embedder's limit as an embedding
    request's are), in the same steps as any pairs. Where they alone score (the dense mode) they are what the
    response's document_tokens and truncated describe, and truncate='none' refuses a document they would cut."""
    embedder = intake.embedder
    if embedder is None:
        raise ValueError(f"the {intake.scorer.mode} rerank mode needs an embedder, and this engine has none")
    params = EmbedParams(priority=job.params.priority)
    cut = job.params.max_document_tokens
    if max_windows > 1:  # a long document in windows of the embedder's limit
        rows = embedder.rows([job.query], None, params) + _window_rows(intake, job, max_windows, cut, params)
    elif cut is None:
        rows = embedder.rows([job.query, *job.documents], None, params)
    else:  # the documents' own tokens cut to `cut` (each text still tokenized once)
        ids = [embedder.with_special_tokens(list(d)[:cut])
               for d in embedder.tokenizer(job.documents, add_special_tokens=False).input_ids]
        rows = embedder.rows([job.query], None, params) + embedder.rows(None, ids, params)
    if intake.scorer.pair_phase is PairPhase.NEVER and max_windows == 1:
        _describe_documents(intake, job, rows[1:])
    job.rows = embed_sequences(intake, job.request_id, rows, params, job.arrival_time,
                                     "a document has too many embedder tokens")
    job.vectors = [None] * len(rows)
    job.remaining += len(rows)

def _window_rows(intake: "RequestIntake", job: RerankJob, max_windows: int, cut: int | None, params: EmbedParams) -> list:
    """The document rows when documents may be windowed: each document's embedder tokens (cut to `cut` first)
    as up to `max_windows` overlapping windows of the embedder's limit, one row each; the job's windows, and in
    the dense mode (where the rows alone score) its documents' tokens covered and cuts, truncate='none' refusing
    one that needs more windows."""
    embedder = intake.embedder
    room = embedder.max_length - embedder.num_special_tokens
    overlap = intake.config.rerank_window_overlap
    alone = intake.scorer.pair_phase is PairPhase.NEVER
    ids = []
    units, windows, covered_tokens, truncated = [], [], [], []
    for i, doc in enumerate(embedder.tokenizer(job.documents, add_special_tokens=False).input_ids):
        doc = list(doc)[:cut] if cut is not None else list(doc)
        parts, cut_off = split_windows(doc, room, overlap, max_windows)
        if cut_off and job.params.truncate == "none" and alone:
            raise InputTooLong(f"documents[{i}] is over {max_windows} windows of the embedder's limit of "
                               f"{embedder.max_length} tokens ({embedder.name}): shorten it, send more "
                               "max_windows or use truncate='end'")
        ids += [embedder.with_special_tokens(p) for p in parts]
        units += [i] * len(parts)
        windows.append(len(parts))
        covered_tokens.append(covered(parts, room, overlap))
        truncated.append(cut_off)
    if alone:
        job.document_tokens, job.truncated = covered_tokens, truncated
    job.windows = windows
    if len(units) != len(job.documents):
        job.row_units = units
    return embedder.rows(None, ids, params)

def _describe_documents(intake: "RequestIntake", job: RerankJob, rows: list) -> None:
    """document_tokens and truncated from the documents' embedder rows; ValueError for a cut one under
    truncate='none'."""
    specials = intake.embedder.num_special_tokens
    if job.params.truncate == "none":
        cut = next((i for i, r in enumerate(rows) if r.truncated), None)
        if cut is not None:
            raise ValueError(f"documents[{cut}] is over the embedder's limit of {intake.embedder.max_length} "
                             f"tokens ({intake.embedder.name}): shorten it or use truncate='end'")
    job.document_tokens = [len(r.token_ids) - specials for r in rows]
    job.truncated = [r.truncated for r in rows]

def rerank_limit(intake: "RequestIntake") -> tuple[int, str]:
    """The most tokens one rerank pair (template, query and document) may have, and what sets that limit.

    A pair the LLM scores is prefilled in chunks across steps like a prompt, so it may fill the model's context;
    a cross-encoder pair runs whole in one step, within its own max_position_embeddings and the step's budget; a
    mode without pairs (dense) sees a document through the embedder, within its limit."""
    if intake.scorer.pair_phase is PairPhase.NEVER and intake.embedder is not None:
        return intake.embedder.max_length, f"the embedder {intake.embedder.name}'s limit, special tokens included"
    if intake.scorer.runs_on_llm:
        return intake.max_model_len, intake.max_model_len_by
    own = intake.scorer.max_length
    if own is not None and own <= intake.budget:
        return own, "the cross-encoder's max_position_embeddings"
    return intake.budget, ("max_num_batched_tokens (tandem serve --max-num-batched-tokens): a cross-encoder pair "
                         "runs whole in one step")
