"""The pooling tasks (engine.config.PoolingTask), one registered descriptor each: the one table the engine reads a
pooling task's parts from (its EngineConfig field and serve flag, what a refusal calls its model, its head, what a
row's pooled output becomes, what model_info says of it). Every task's rows are an embedding job's rows on its own
encoder. The embedder's row is here; every other task's is its module's `KIND` in engine/embed/heads/, so a new
pooling task is a member of PoolingTask and its EngineConfig field (engine/config.py) and a module there.
"""
from __future__ import annotations

import torch

from engine.config import EmbedParams, PoolingTask
from engine.embed import heads
from engine.embed.heads import Encoder, PoolingKind

__all__ = ["Encoder", "POOLING", "PoolingKind", "model_info", "with_heads"]


def _embedding(encoder: "Encoder", vector: torch.Tensor, params: EmbedParams) -> list:
    """A pooled vector as the request asks: its first `dimensions` (Matryoshka), then L2-normalised (token states,
    `all_tokens`: each token's state normalised the same way when asked)."""
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.tolist()


POOLING: dict[PoolingTask, PoolingKind] = {k.task: k for k in (
    PoolingKind(PoolingTask.EMBED, "embedder", "--embedder", "embedding model", _embedding),
    *heads.kinds(),  # each module of engine/embed/heads/: a classifier, a sparse embedder
)}
if set(POOLING) != set(PoolingTask):
    raise RuntimeError(f"pooling tasks with no module in engine/embed/heads/: {set(PoolingTask) - set(POOLING)}")


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
