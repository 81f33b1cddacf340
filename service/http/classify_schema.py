"""Classification and sparse-embedding bodies: TEI's /predict (one text or a batch, `raw_scores`), vLLM's /classify
and TEI's /embed_sparse, to the core API's EmbedInput (the embedding request, run by the classifier or the sparse
embedder: CoreAPI.pool), and the outcomes back to each shape. `ROUTES`: each route's body, answer and shape, which
the HTTP door serves for the routes service/kinds.py gives these kinds (service/http/kind_routes.py)."""
from __future__ import annotations

from typing import Union

from engine.config import EmbedParams
from service.core import EmbedInput, PooledOutcome
from service.http.errors import HttpError, Shape
from service.http.kind_routes import KindRoute
from service.http.openai_schema import refuse_extras
from service.http.rerank_schema import TEI_CUT_HINT
from service.http.embed_schema import _Model


def _params(**kwargs) -> EmbedParams:
    try:
        return EmbedParams(**kwargs)
    except ValueError as exc:
        raise HttpError(400, str(exc)) from None


def _direction(value: str | None) -> str:
    direction = (value or "right").lower()
    if direction not in ("right", "left"):
        raise HttpError(400, f"truncation_direction must be 'Right' or 'Left', got {value!r}",
                        param="truncation_direction")
    return direction


class TeiPredict(_Model):
    """TEI /predict, read as TEI reads `inputs`: a string is one text; a list of strings is ONE input, a text (`["a"]`)
    or a text pair (`["premise", "hypothesis"]`, for NLI and cross-encoder classifiers; three or more strings are
    refused, as TEI refuses them); a list of lists is a batch, each a text (`["a"]`) or a pair (`["a", "b"]`). One
    input (not a batch) is answered with its one list of labels. As TEI: `truncate` defaults to false, `raw_scores`
    (the logits, not probabilities) to false."""
    inputs: Union[str, list[str], list[list[str]]]
    raw_scores: bool = False
    truncate: bool | None = None
    truncation_direction: str | None = None

    @property
    def single(self) -> bool:
        """One input (a text or a pair), not a batch: answered with one list of labels."""
        return isinstance(self.inputs, str) or all(isinstance(x, str) for x in self.inputs)

    def to_input(self) -> EmbedInput:
        refuse_extras(self)
        if isinstance(self.inputs, str):
            inputs = [self.inputs]
        elif self.single:  # ["text"] or ["text", "text_pair"]: one input, as TEI reads it
            inputs = [_sequence(self.inputs, "inputs")] if self.inputs else []
        else:
            inputs = [_sequence(x, f"inputs[{i}]") for i, x in enumerate(self.inputs)]
        params = _params(raw_scores=self.raw_scores, truncate=bool(self.truncate),
                         truncation_direction=_direction(self.truncation_direction))
        return EmbedInput("", inputs, params, cut_hint=TEI_CUT_HINT)


def _sequence(value: list[str], where: str) -> str | tuple[str, str]:
    """One TEI sequence: [text] or [text, text_pair]."""
    if len(value) == 1:
        return value[0]
    if len(value) == 2:
        return value[0], value[1]
    raise HttpError(400, f"{where} has {len(value)} strings: an input is a text [\"text\"] or a pair [\"text\", "
                    "\"text_pair\"], as TEI reads it; send a batch as a list of them: [[\"a\"], [\"b\", \"c\"]]",
                    param="inputs")


def tei_predict_response(outcome: PooledOutcome, single: bool) -> list:
    """Per input, every label with its score, highest first (TEI's order); one input (a string, ["text"] or a pair
    ["text", "text_pair"], not a batch): its one list."""
    ranked = [sorted(({"label": label, "score": s} for label, s in zip(outcome.labels, scores)),
                     key=lambda x: -x["score"]) for scores in outcome.outputs]
    return ranked[0] if single else ranked


class VllmClassify(_Model):
    """vLLM /classify: `input` one text or a list of texts."""
    input: Union[str, list[str]]
    model: str = ""
    truncate_prompt_tokens: int | None = None  # accepted as vLLM's: -1 or unset; a cut at N tokens is not supported
    priority: int | None = None
    user: str | None = None

    def to_input(self) -> EmbedInput:
        if self.truncate_prompt_tokens not in (None, -1):
            raise HttpError(400, "truncate_prompt_tokens: only -1 (cut at the classifier's limit) is supported",
                            param="truncate_prompt_tokens")
        refuse_extras(self)
        inputs = [self.input] if isinstance(self.input, str) else list(self.input)
        params = _params(truncate=self.truncate_prompt_tokens == -1, priority=self.priority or 0)
        return EmbedInput("", inputs, params, model=self.model,
                          cut_hint="send truncate_prompt_tokens: -1 to cut it at the classifier's limit")


def vllm_classify_response(outcome: PooledOutcome, model: str) -> dict:
    data = [{"index": i, "label": outcome.labels[max(range(len(p)), key=p.__getitem__)], "probs": p,
             "num_classes": len(p)} for i, p in enumerate(outcome.outputs)]
    tokens = outcome.usage.prompt_tokens
    return {"id": f"classify-{outcome.id}", "object": "list", "created": 0, "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


class TeiEmbedSparse(_Model):
    """TEI /embed_sparse: `inputs` one text or a list; `truncate` defaults to false, as TEI's."""
    inputs: Union[str, list[str]]
    truncate: bool | None = None
    truncation_direction: str | None = None
    prompt_name: str | None = None

    def to_input(self) -> EmbedInput:
        if self.prompt_name is not None:
            raise HttpError(400, "prompt_name is not supported: put the prompt in the text", param="prompt_name")
        refuse_extras(self)
        inputs = [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)
        params = _params(truncate=bool(self.truncate), truncation_direction=_direction(self.truncation_direction))
        return EmbedInput("", inputs, params, cut_hint=TEI_CUT_HINT)


def tei_sparse_response(outcome: PooledOutcome) -> list:
    """Per input, its non-zero weights as [{index, value}], vocabulary id order (TEI's shape)."""
    return [[{"index": i, "value": v} for i, v in vec] for vec in outcome.outputs]


ROUTES = {
    "/predict": KindRoute(TeiPredict, lambda outcome, body: tei_predict_response(outcome, body.single), Shape.TEI),
    "/classify": KindRoute(VllmClassify, lambda outcome, body: vllm_classify_response(outcome,
                                                                                      body.model or outcome.model),
                           Shape.OPENAI),
    "/embed_sparse": KindRoute(TeiEmbedSparse, lambda outcome, body: tei_sparse_response(outcome), Shape.TEI),
}
