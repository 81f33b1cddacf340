"""The pooling tasks (engine.config.PoolingTask), one registered descriptor each: the one table the engine reads a
pooling task's parts from (its EngineConfig field and serve flag, what a refusal calls its model, its head, what a
row's pooled output becomes, what model_info says of it). Every task's rows are an embedding job's rows on its own
encoder, so a new pooling task is a member of PoolingTask, its head (engine/embed/heads.py) and a row here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from engine.config import EmbedParams, PoolingTask
from engine.embed.heads import Head, load_classifier, load_splade


class Encoder(Protocol):
    """What this table reads of a loaded pooling encoder (engine/embed/embedder.py's Embedder; it imports this
    module, so the table names only what it reads)."""
    name: str
    labels: tuple[str, ...]
    multi_label: bool
    max_length: int


def _embedding(encoder: "Encoder", vector: torch.Tensor, params: EmbedParams) -> list:
    """A pooled vector as the request asks: its first `dimensions` (Matryoshka), then L2-normalised (token states,
    `all_tokens`: each token's state normalised the same way when asked)."""
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.tolist()


def _probabilities(encoder: "Encoder", vector: torch.Tensor, params: EmbedParams) -> list[float]:
    """A classifier's logits as its labels' probabilities (softmax; sigmoid per label for a multi-label model), or
    the logits with raw_scores."""
    if params.raw_scores:
        return vector.tolist()
    return (torch.sigmoid(vector) if encoder.multi_label else torch.softmax(vector, dim=-1)).tolist()


def _sparse(encoder: "Encoder", vector: torch.Tensor, params: EmbedParams) -> list[tuple[int, float]]:
    """A sparse vector as its non-zero (vocabulary id, weight) pairs, id order."""
    ids = vector.nonzero().flatten()
    return list(zip(ids.tolist(), vector[ids].tolist()))


@dataclass(frozen=True, slots=True)
class PoolingKind:
    task: PoolingTask
    field: str  # the EngineConfig field naming its model, and model_info's key for its id (`<field>_max_tokens` too)
    flag: str  # the `tandem serve` flag that loads it (named where its model is missing or wrong)
    model: str  # what a refusal calls its model
    finish: Callable[["Encoder", torch.Tensor, EmbedParams], list]  # a row's pooled output, as its request asks
    head: Callable[..., Head] | None = None  # loads its head on an encoder (None: the embedder's own pooling)
    labels: bool = False  # model_info lists its labels (`<field>_labels`)


POOLING: dict[PoolingTask, PoolingKind] = {k.task: k for k in (
    PoolingKind(PoolingTask.EMBED, "embedder", "--embedder", "embedding model", _embedding),
    PoolingKind(PoolingTask.CLASSIFY, "classifier", "--classifier", "classifier", _probabilities, load_classifier,
                labels=True),
    PoolingKind(PoolingTask.SPARSE, "sparse_embedder", "--sparse-embedder", "sparse embedder (SPLADE)", _sparse,
                load_splade),
)}


def with_heads() -> tuple[PoolingKind, ...]:
    """The tasks whose encoder carries a head of its own (loaded beside the embedder), registry order."""
    return tuple(k for k in POOLING.values() if k.head is not None)


def model_info(poolers: "dict[PoolingTask, Encoder]") -> dict:
    """What engine.model_info says of the head-carrying encoders: each one's id ("": not loaded) and limit, and the
    labels of those that have them."""
    out: dict = {}
    for kind in with_heads():
        encoder = poolers.get(kind.task)
        out[kind.field] = encoder.name if encoder else ""
        if kind.labels:
            out[f"{kind.field}_labels"] = list(encoder.labels) if encoder else []
        out[f"{kind.field}_max_tokens"] = encoder.max_length if encoder else 0
    return out
