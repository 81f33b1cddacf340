"""A pooling request's intake (embed, classify, sparse embed: EmbedParams.task picks the encoder): its spec checked
and tokenized into its job, one KV-free encoder row per input, on any thread. Registered in engine/kinds.py; reads
the engine's fixed parts through the RequestIntake it is given."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.config import EmbedParams, PoolingTask
from engine.embed.embedder import Embedder
from engine.embed.job import EmbedJob
from engine.embed.tasks import POOLING
from engine.errors import NotLoaded
from engine.request import RowExec, SeqKind, Sequence
from engine.specs import EmbedSpec

if TYPE_CHECKING:
    from engine.intake import RequestIntake


def embed_sequences(intake: "RequestIntake", request_id: str, rows: list, params: EmbedParams, arrival_time: float,
                     too_long: str, encoder: Embedder | None = None) -> list[Sequence]:
    """One KV-free EMBED sequence per embedder row, input order, each run in the embedder's stages; ValueError
    (`too_long`, the budget) when one stage of a row exceeds one step's budget (a decoder embedder's row is one
    stage: it runs whole). `encoder`: the one that runs them (None: the embedder)."""
    encoder = encoder or intake.embedder
    seqs = [Sequence(request_id=request_id, token_ids=row.token_ids, num_prompt_tokens=len(row.token_ids),
                     params=params, arrival=next(intake.arrivals), arrival_time=arrival_time, kind=SeqKind.EMBED,
                     priority=params.priority, execution=RowExec.ENCODER, index=i, stages=encoder.stages,
                     token_type_ids=row.token_type_ids)
            for i, row in enumerate(rows)]
    if any(seq.stage_tokens(1) > intake.budget for seq in seqs):
        what = "one layer of it" if encoder.stages > 1 else "it runs whole and"
        raise ValueError(f"{too_long}: {what} must fit in one step's budget ({intake.budget}, "
                         "--max-num-batched-tokens)")
    return seqs

def build(intake: "RequestIntake", spec: EmbedSpec) -> EmbedJob:
    """A job with one prefill-only, KV-free row per input (texts, or token ids in the embedder's vocabulary), run
    by the encoder of its params' task (the embedder, the classifier, the sparse embedder)."""
    request_id, inputs = spec.request_id, spec.inputs
    params = spec.params if spec.params is not None else EmbedParams()
    if not isinstance(params, EmbedParams):
        raise ValueError("params must be an EmbedParams")
    embedder = intake.poolers.get(params.task)
    if embedder is None:
        kind = POOLING[params.task]
        how = "DIR, or leave the default: the embedded all-MiniLM-L6-v2" if kind.head is None else "DIR|HUB_ID"
        raise NotLoaded(f"this server has no {kind.model} (tandem serve {kind.flag} {how}; "
                        f"EngineConfig.{kind.field})")
    if not isinstance(inputs, (list, tuple)):
        raise ValueError("input must be a list of strings or of token id lists")
    if not inputs:
        raise ValueError("input must not be empty: give one or more texts (or token id lists)")
    if len(inputs) > intake.config.max_embed_inputs:
        raise ValueError(f"input has {len(inputs)} items; this server takes at most {intake.config.max_embed_inputs}"
                         " per request (--max-embed-inputs, EngineConfig.max_embed_inputs); split the request")
    texts = ids = None
    if all(isinstance(t, str) or _text_pair(t) for t in inputs):
        if any(not t for t in inputs) or any(not isinstance(t, str) and not all(t) for t in inputs):
            raise ValueError("input must not contain empty strings")
        texts = [t if isinstance(t, str) else tuple(t) for t in inputs]
        if params.task is not PoolingTask.CLASSIFY and any(isinstance(t, tuple) for t in texts):
            raise ValueError("input: text pairs ([text, text_pair]) are classified only (a sequence classifier "
                             "reads the pair, as a cross-encoder or an NLI model does); give texts")
    elif all(isinstance(t, (list, tuple)) for t in inputs):
        vocab = len(embedder.tokenizer)
        for i, t in enumerate(inputs):
            if not t or any(not isinstance(x, int) or isinstance(x, bool) for x in t):
                raise ValueError(f"input[{i}] must be a non-empty list of token ids in [0, {vocab}) (the "
                                 f"embedder {embedder.name}'s vocabulary)")
            outside = next((x for x in t if not 0 <= x < vocab), None)
            if outside is not None:
                raise ValueError(_foreign_ids(i, outside, vocab, embedder.name))
        ids = [list(t) for t in inputs]
    else:
        raise ValueError("input must be all strings or all token id lists")
    embedder.check_dimensions(params)
    rows = embedder.rows(texts, ids, params)
    arrival_time = time.monotonic()
    sequences = embed_sequences(intake, request_id, rows, params, arrival_time, "an input has too many tokens",
                                      embedder)
    return EmbedJob(request_id, params, arrival_time=arrival_time, rows=sequences, vectors=[None] * len(rows),
                    remaining=len(rows), truncated=[r.truncated for r in rows])


def _text_pair(value) -> bool:
    """A classification's text pair: [text, text_pair] (a list or tuple of two strings)."""
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(x, str) for x in value)


def _foreign_ids(index: int, token: int, vocab: int, name: str) -> str:
    """The refusal of a token id outside the embedder's vocabulary: most likely another tokenizer's ids (LangChain's
    OpenAIEmbeddings sends tiktoken's unless told not to), which would embed as garbage if they happened to fit."""
    return (f"input[{index}] has token id {token}, outside the embedder {name}'s vocabulary [0, {vocab}): token ids "
            "must be this model's own (its tokenizer's input_ids), or send the text. LangChain's OpenAIEmbeddings "
            "sends tiktoken's ids unless given check_embedding_ctx_length=False")
