"""Rerank request bodies in Cohere's (v1, v2; Jina's fields too) and TEI's shapes, to the core API's RerankInput,
and its RerankOutcome back to each shape. Scores are the gRPC Rerank's, unchanged."""
from __future__ import annotations

from typing import Union

from pydantic import BaseModel, ConfigDict

from engine.config import RerankParams
from service.core import RerankInput, RerankOutcome
from service.http.errors import HttpError
from service.http.openai_schema import refuse_extras

_UNSUPPORTED = {"rank_fields": "documents are plain text (a string or {\"text\": ...})",
                "raw_scores": "scores are in [0, 1] (see docs/http.md)",
                "truncation_direction": "documents are cut at the end only"}


TEI_CUT_HINT = "send truncate: true to cut it at its end"  # TEI's truncate is a boolean, false by default


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class TextDocument(_Model):
    text: str


class CohereRerank(_Model):
    """Cohere /v1/rerank and /v2/rerank (Jina's /v1/rerank is the same shape)."""
    query: str
    documents: list[Union[str, TextDocument]]
    model: str = ""
    top_n: int | None = None
    return_documents: bool | None = None
    max_tokens_per_doc: int | None = None
    max_chunks_per_doc: int | None = None  # Cohere v1's: a long document as up to N windows, scored as its best
    # tandem's own
    instruction: str | None = None
    priority: int | None = None
    truncate: bool | None = None  # false: a document too long is refused instead of cut

    def to_input(self, default_return_documents: bool) -> RerankInput:
        _refuse(self)
        for i, d in enumerate(self.documents):
            if isinstance(d, TextDocument):
                refuse_extras(d, f"documents[{i}].")
        if self.max_chunks_per_doc is not None and self.max_chunks_per_doc < 1:
            raise HttpError(400, f"max_chunks_per_doc must be >= 1, got {self.max_chunks_per_doc}",
                            param="max_chunks_per_doc")
        params = _params(truncate="none" if self.truncate is False else "end",
                         instruction=self.instruction, priority=_int32(self.priority or 0, "priority"),
                         max_windows=self.max_chunks_per_doc)
        return _input("", self.query, self.texts(), params, model=self.model,
                      max_tokens_per_doc=self.max_tokens_per_doc,
                      cut_hint="send truncate: true (or leave it out) to cut it at its end",
                      top_n=None if self.top_n is None else _int32(self.top_n, "top_n"),
                      return_documents=default_return_documents if self.return_documents is None
                      else self.return_documents)

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class TeiRerank(_Model):
    """TEI /rerank."""
    query: str
    texts: list[str]
    truncate: bool | None = None
    raw_scores: bool | None = None
    return_text: bool | None = None
    truncation_direction: str | None = None
    # tandem's own (TEI has neither): the judge's instruction, and a long document as up to N windows (its best)
    instruction: str | None = None
    max_windows: int | None = None

    def to_input(self) -> RerankInput:
        if self.truncation_direction not in (None, "Right", "right"):
            raise HttpError(400, "truncation_direction: documents are cut at the end only ('Right')",
                            param="truncation_direction")
        if self.raw_scores:
            raise HttpError(400, f"raw_scores is not supported: {_UNSUPPORTED['raw_scores']}", param="raw_scores")
        refuse_extras(self)
        return _input("", self.query, list(self.texts),
                      _params(truncate="end" if self.truncate else "none", instruction=self.instruction,
                              max_windows=self.max_windows),
                      cut_hint=TEI_CUT_HINT, return_documents=bool(self.return_text))


def _params(**kwargs) -> RerankParams:
    try:
        return RerankParams(**kwargs)
    except ValueError as exc:
        raise HttpError(400, str(exc)) from None


def _input(*args, **kwargs) -> RerankInput:
    try:
        return RerankInput(*args, **kwargs)
    except ValueError as exc:
        raise HttpError(400, str(exc)) from None


def _refuse(model: BaseModel) -> None:
    for name in model.model_extra or {}:
        if name in _UNSUPPORTED and model.model_extra[name] not in (None, False, [], {}, ""):
            raise HttpError(400, f"{name} is not supported: {_UNSUPPORTED[name]}", param=name)
    refuse_extras(model)


def _int32(value: int, name: str) -> int:
    if not -(2**31) <= value < 2**31:
        raise HttpError(400, f"{name} is out of range: {value}", param=name)
    return value


MODE_HEADER = "x-tandem-rerank-mode"  # which rerank mode scored a response (its body keeps each API's own shape)


def mode_header(outcome: RerankOutcome) -> dict[str, str]:
    return {MODE_HEADER: str(outcome.mode)}


def cohere_response(outcome: RerankOutcome, *, model: str) -> dict:
    """Cohere's fields (id, results, meta) plus Jina's (model, usage, document as {text})."""
    results = []
    for r in outcome.results:
        item = {"index": r.index, "relevance_score": r.score, "windows": r.windows}
        if r.document is not None:
            item["document"] = {"text": r.document}
        results.append(item)
    tokens = outcome.usage.prompt_tokens
    return {"id": outcome.id, "model": model, "results": results,
            "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1},
                     "tokens": {"input_tokens": tokens, "output_tokens": 0}},
            "usage": {"total_tokens": tokens, "prompt_tokens": tokens}}


def tei_response(outcome: RerankOutcome) -> list[dict]:
    out = []
    for r in outcome.results:
        item = {"index": r.index, "score": r.score, "windows": r.windows}
        if r.document is not None:
            item["text"] = r.document
        out.append(item)
    return out
