"""The kinds of work the service serves, one registered descriptor each: the one table above the engine that says
what a kind is called and how it is told apart (its task on /v1/models, what a refusal says it does, its lifecycle
label for spans, metrics and the access log, the letter of its request ids, the HTTP routes it comes on, the gRPC
method its access-log line names; for a kind with an encoder of its own, the engine's pooling task that runs it, the
`ModelInfo.encoders` entry naming its model, the `tandem serve` flag that loads it, the door schema module that
holds its HTTP bodies and what one input's output is as its gRPC response's item, in plain data). It imports no
engine (no torch) and no protobuf, so `tandem`'s CLI reads its flags from here.

Code outside this module reads a kind's descriptor (`KINDS[task]`, `by_label(lc.kind)`, `by_route(path)`) and never
branches on which kind it is (tests/test_kind_checks.py): a new kind is a new `Task` member and a new row here, beside
its own package in the engine, its door's schema, its proto messages and its client.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence


class Task(str, enum.Enum):
    """What a listed model does (HTTP /v1/models' `task` and `capabilities`): one kind of work."""
    GENERATE = "generate"  # chat and completions
    EMBED = "embed"
    RERANK = "rerank"
    CLASSIFY = "classify"
    EMBED_SPARSE = "embed_sparse"

    __format__ = str.__format__


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of work as the service names and counts it."""
    task: Task
    verb: str  # what a refusal says a model does ("model 'x' does not <verb>")
    label: str  # its lifecycle kind (RequestLifecycle.kind: spans, metrics, the access log): its engine spec's kind
    routes: tuple[str, ...]  # the HTTP routes its requests come on (a door's own refusals are labelled by them)
    grpc_method: str  # its gRPC method (the access log names it; one sharing its label with another kind is named by
    # the method metadata the gRPC door sets)
    stream_method: str = ""  # the method of the gRPC stream that carries it, where one does ("" : none)
    decodes: bool = False  # it streams completions: completion tokens, TTFT, TPOT
    scores_pairs: bool = False  # its inputs are scored as (query, document) pairs: the rerank metrics, documents=
    inputs_attribute: str = "tandem.embed.inputs"  # the span attribute that counts its inputs (when it does not decode)
    # an encoder of its own, beside the LLM and the embedder: its engine task (engine.config.PoolingTask's value:
    # engine/embed/tasks.py), the EngineConfig field naming its model (engine.model_info's key for its id, and
    # `<field>_max_tokens`, `<field>_labels`), the `tandem serve` flag that loads it (service/cli.py adds it with
    # `flag_help`), the HTTP door's schema module for its routes (service/http/app.py reads its `ROUTES`) and its
    # gRPC item: one input's output (PooledOutcome.outputs[i]) and the encoder's labels as the fields of the item
    # message its response repeats, one per input (ClassifyResponse.results, EmbedSparseResponse.embeddings), plain
    # data the gRPC door fills the message from (servicer.py pooled_response; the door adds `truncated`)
    pooling: str = ""
    model_field: str = ""
    flag: str = ""
    flag_help: str = ""
    http_schema: str = ""
    grpc_item: Callable[[list, Sequence[str]], dict] | None = None
    # a request naming the LLM is served anyway (the LLM was listed as doing this kind until issue 72), unless names
    # are strict
    llm_alias: bool = False

    @property
    def letter(self) -> str:
        """The first letter of its request ids (`new_request_id`)."""
        return self.label[0]


def _classification(scores: list[float], labels: Sequence[str]) -> dict:
    """A Classification's fields: every label with its score (a probability, or a logit with raw_scores), label id
    order."""
    return {"scores": [{"label": label, "score": score} for label, score in zip(labels, scores)]}


def _sparse_embedding(pairs: list[tuple[int, float]], labels: Sequence[str]) -> dict:
    """A SparseEmbedding's fields: the non-zero (vocabulary id, weight) pairs as two lists, id order."""
    return {"indices": [i for i, _ in pairs], "values": [v for _, v in pairs]}


KINDS: dict[Task, Kind] = {k.task: k for k in (
    Kind(Task.GENERATE, "generate (chat, completions)", "generate", ("/v1/chat/completions", "/v1/completions"),
         "Generate", decodes=True),
    Kind(Task.RERANK, "rerank", "rerank", ("/v1/rerank", "/v2/rerank", "/rerank"), "Rerank",
         stream_method="RerankStream", scores_pairs=True, inputs_attribute="tandem.rerank.pairs", llm_alias=True),
    Kind(Task.EMBED, "embed", "embed", ("/v1/embeddings", "/embed", "/embed_all", "/v2/embed"), "Embed"),
    Kind(Task.CLASSIFY, "classify", "embed", ("/predict", "/classify"), "Classify", pooling="classify",
         model_field="classifier", flag="--classifier",
         flag_help="a sequence classifier to serve (TEI /predict, vLLM /classify, gRPC Classify): a Hugging Face "
                   "directory or Hub id of a BERT / RoBERTa / XLM-R / ModernBERT ...ForSequenceClassification with "
                   "id2label (default: none)",
         http_schema="service.http.classify_schema", grpc_item=_classification),
    Kind(Task.EMBED_SPARSE, "embed sparse", "embed", ("/embed_sparse",), "EmbedSparse", pooling="sparse",
         model_field="sparse_embedder", flag="--sparse-embedder",
         flag_help="a SPLADE model to serve sparse embeddings with (TEI /embed_sparse, gRPC EmbedSparse): a "
                   "directory or Hub id of a BERT-family ...ForMaskedLM (default: none)",
         http_schema="service.http.classify_schema", grpc_item=_sparse_embedding),
)}

_BY_LABEL = {}
for _kind in KINDS.values():
    _BY_LABEL.setdefault(_kind.label, _kind)
_BY_ROUTE = {route: kind for kind in KINDS.values() for route in kind.routes}
LABELS = tuple(_BY_LABEL)  # every lifecycle label, registry order


def by_label(label: str) -> Kind | None:
    """The kind a lifecycle label names (the first registered with it); None for a label no kind has."""
    return _BY_LABEL.get(label)


def by_route(path: str) -> Kind | None:
    """The kind whose requests come on HTTP route `path`; None for a route of no kind (/tokenize, /v1/models)."""
    return _BY_ROUTE.get(path)


def pooled() -> tuple[Kind, ...]:
    """The kinds served by an encoder of their own (a classifier, a sparse embedder), registry order."""
    return tuple(k for k in KINDS.values() if k.pooling)
