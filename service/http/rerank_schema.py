"""Rerank request bodies in Cohere's (v1, v2; Jina's fields too) and TEI's shapes, to tandem.v1 RerankRequests,
and RerankResponses back to each shape. Scores are the gRPC Rerank's, unchanged."""
from __future__ import annotations

import uuid
from typing import Union

from pydantic import BaseModel, ConfigDict

from proto import tandem_pb2 as pb
from service.http.errors import HttpError
from service.http.openai_schema import refuse_extras

_UNSUPPORTED = {"rank_fields": "documents are plain text (a string or {\"text\": ...})",
                "max_chunks_per_doc": "documents are scored whole (cut at the end with truncation)",
                "raw_scores": "scores are in [0, 1] (see docs/http.md)",
                "truncation_direction": "documents are cut at the end only"}


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
    # tandem's own
    instruction: str | None = None
    priority: int | None = None
    truncate: bool | None = None  # false: a document too long is refused instead of cut

    def to_request(self) -> pb.RerankRequest:
        _refuse(self)
        for i, d in enumerate(self.documents):
            if isinstance(d, TextDocument):
                refuse_extras(d, f"documents[{i}].")
        req = pb.RerankRequest(query=self.query, documents=self.texts(), model=self.model,
                               truncate=pb.TRUNCATE_NONE if self.truncate is False else pb.TRUNCATE_END,
                               priority=_int32(self.priority or 0, "priority"))
        if self.top_n is not None:
            req.top_n = _int32(self.top_n, "top_n")
        if self.instruction is not None:
            req.instruction = self.instruction
        return req

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

    def to_request(self) -> pb.RerankRequest:
        if self.truncation_direction not in (None, "Right", "right"):
            raise HttpError(400, "truncation_direction: documents are cut at the end only ('Right')",
                            param="truncation_direction")
        if self.raw_scores:
            raise HttpError(400, f"raw_scores is not supported: {_UNSUPPORTED['raw_scores']}", param="raw_scores")
        refuse_extras(self)
        return pb.RerankRequest(query=self.query, documents=self.texts,
                                truncate=pb.TRUNCATE_END if self.truncate else pb.TRUNCATE_NONE)


def _refuse(model: BaseModel) -> None:
    for name in model.model_extra or {}:
        if name in _UNSUPPORTED and model.model_extra[name] not in (None, False, [], {}, ""):
            raise HttpError(400, f"{name} is not supported: {_UNSUPPORTED[name]}", param=name)
    refuse_extras(model)


def _int32(value: int, name: str) -> int:
    if not -(2**31) <= value < 2**31:
        raise HttpError(400, f"{name} is out of range: {value}", param=name)
    return value


def cohere_response(response: pb.RerankResponse, documents: list[str], *, return_documents: bool,
                    model: str) -> dict:
    """Cohere's fields (id, results, meta) plus Jina's (model, usage, document as {text})."""
    results = []
    for r in response.results:
        item = {"index": r.index, "relevance_score": r.score}
        if return_documents:
            item["document"] = {"text": documents[r.index]}
        results.append(item)
    tokens = response.usage.prompt_tokens
    return {"id": uuid.uuid4().hex, "model": model, "results": results,
            "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1},
                     "tokens": {"input_tokens": tokens, "output_tokens": 0}},
            "usage": {"total_tokens": tokens, "prompt_tokens": tokens}}


def tei_response(response: pb.RerankResponse, texts: list[str], *, return_text: bool) -> list[dict]:
    out = []
    for r in response.results:
        item = {"index": r.index, "score": r.score}
        if return_text:
            item["text"] = texts[r.index]
        out.append(item)
    return out
