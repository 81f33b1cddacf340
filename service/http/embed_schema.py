"""Embedding request bodies in OpenAI's (/v1/embeddings), TEI's (/embed) and Cohere's (/v2/embed) shapes, to the core
API's EmbedInput, and its EmbedOutcome back to each shape. The vectors are the gRPC Embed's, unchanged (float32)."""
from __future__ import annotations

import base64
from typing import Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict

from engine.config import EmbedParams
from service.core import EmbedInput, EmbedOutcome
from service.http.errors import HttpError
from service.http.openai_schema import refuse_extras
from service.http.rerank_schema import TEI_CUT_HINT


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


def _params(**kwargs) -> EmbedParams:
    try:
        return EmbedParams(**kwargs)
    except ValueError as exc:
        raise HttpError(400, str(exc)) from None


class OpenAIEmbed(_Model):
    """OpenAI /v1/embeddings. Token ids are the model's exact input in the served embedder's own vocabulary (never
    tiktoken's), taken as given: special tokens included, nothing added (as vLLM); an input over the embedder's
    limit is cut at its end unless `truncate` (tandem's own) is false."""
    input: Union[str, list[str], list[int], list[list[int]]]
    model: str = ""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted and ignored, as vLLM does
    # tandem's own
    truncate: bool | None = None
    priority: int | None = None

    def to_input(self) -> EmbedInput:
        refuse_extras(self)
        inputs = self.input
        if isinstance(inputs, str):
            inputs = [inputs]
        elif inputs and all(isinstance(t, int) for t in inputs):
            inputs = [inputs]  # one input given as token ids
        params = _params(dimensions=self.dimensions, truncate=self.truncate is not False,
                         priority=self.priority or 0)
        return EmbedInput("", list(inputs), params, model=self.model,
                          cut_hint="send truncate: true (or leave it out) to cut it at its end")


def openai_response(outcome: EmbedOutcome, encoding_format: str, model: str) -> dict:
    data = [{"object": "embedding", "index": i,
             "embedding": _base64(v) if encoding_format == "base64" else v}
            for i, v in enumerate(outcome.embeddings)]
    tokens = outcome.usage.prompt_tokens
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 values, little-endian, base64."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


class TeiEmbed(_Model):
    """TEI /embed. As TEI: `truncate` defaults to false (an input over the limit is refused), `normalize` to true."""
    inputs: Union[str, list[str]]
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: str | None = None  # "Right" | "Left"
    prompt_name: str | None = None
    dimensions: int | None = None

    def to_input(self) -> EmbedInput:
        if self.prompt_name is not None:
            raise HttpError(400, "prompt_name is not supported: the served embedder has no named prompts; put the "
                            "prompt in the text", param="prompt_name")
        direction = (self.truncation_direction or "right").lower()
        if direction not in ("right", "left"):
            raise HttpError(400, f"truncation_direction must be 'Right' or 'Left', got {self.truncation_direction!r}",
                            param="truncation_direction")
        refuse_extras(self)
        inputs = [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)
        params = _params(normalize=self.normalize, truncate=bool(self.truncate), truncation_direction=direction,
                         dimensions=self.dimensions)
        return EmbedInput("", inputs, params, cut_hint=TEI_CUT_HINT)


class TeiEmbedAll(_Model):
    """TEI /embed_all: every token's final hidden state per input ([tokens][dim], special tokens included), no
    pooling and no normalisation, as TEI answers it. `truncate` defaults to false, as TEI's."""
    inputs: Union[str, list[str]]
    truncate: bool | None = None
    truncation_direction: str | None = None  # "Right" | "Left"
    prompt_name: str | None = None

    def to_input(self) -> EmbedInput:
        refuse_extras(self)  # TEI's /embed_all takes no normalize or dimensions either
        pooled = TeiEmbed(inputs=self.inputs, truncate=self.truncate, truncation_direction=self.truncation_direction,
                          prompt_name=self.prompt_name).to_input()
        return EmbedInput(pooled.request_id, pooled.inputs,
                          _params(normalize=False, truncate=pooled.params.truncate,
                                  truncation_direction=pooled.params.truncation_direction, all_tokens=True),
                          cut_hint=TEI_CUT_HINT)


_INPUT_TYPES = ("search_document", "search_query", "classification", "clustering")
_EMBEDDING_TYPES = ("float", "int8", "uint8", "base64")


class CohereEmbed(_Model):
    """Cohere /v2/embed. input_type is checked and otherwise unused (the served embedder has no per-type prompts);
    truncate END (the default) cuts an input at its end, START at its start, NONE refuses it."""
    texts: list[str] | None = None
    model: str = ""
    input_type: str | None = None
    embedding_types: list[str] | None = None
    truncate: str | None = None
    output_dimension: int | None = None
    images: list | None = None
    inputs: list | None = None

    def to_input(self) -> EmbedInput:
        if self.images or self.inputs:
            raise HttpError(400, "images and inputs are not supported: send texts")
        if self.texts is None:
            raise HttpError(400, "texts is required")
        if self.input_type is not None and self.input_type not in _INPUT_TYPES:
            raise HttpError(400, f"input_type must be one of {', '.join(_INPUT_TYPES)}, got {self.input_type!r}")
        for t in self.types:
            if t not in _EMBEDDING_TYPES:
                raise HttpError(400, f"embedding_types: {t!r} is not supported; supported: "
                                f"{', '.join(_EMBEDDING_TYPES)}")
        truncate = (self.truncate or "END").upper()
        if truncate not in ("NONE", "START", "END"):
            raise HttpError(400, f"truncate must be NONE, START or END, got {self.truncate!r}")
        refuse_extras(self)
        params = _params(truncate=truncate != "NONE", truncation_direction="left" if truncate == "START" else "right",
                         dimensions=self.output_dimension)
        return EmbedInput("", list(self.texts), params, model=self.model,
                          cut_hint='send truncate: "END" (or "START", or leave it out) to cut it')

    @property
    def types(self) -> list[str]:
        return self.embedding_types or ["float"]


def cohere_response(outcome: EmbedOutcome, body: CohereEmbed) -> dict:
    """Cohere v2's embeddings by type. int8 / uint8: each (normalised) value scaled by 127 and rounded, uint8 shifted
    by 128; base64: the float32 values as OpenAI encodes them."""
    vectors = np.asarray(outcome.embeddings, dtype=np.float32)
    by_type = {}
    for t in body.types:
        if t == "float":
            by_type[t] = outcome.embeddings
        elif t == "base64":
            by_type[t] = [_base64(v) for v in outcome.embeddings]
        else:
            q = np.clip(np.rint(vectors * 127), -127, 127).astype(np.int32)
            by_type[t] = (q if t == "int8" else q + 128).tolist()
    return {"id": outcome.id, "embeddings": by_type, "texts": list(body.texts or []),
            "response_type": "embeddings_by_type",
            "meta": {"api_version": {"version": "2"},
                     "billed_units": {"input_tokens": outcome.usage.prompt_tokens}}}
