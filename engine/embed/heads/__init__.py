"""The kinds of pooling past plain embeddings (engine.config.PoolingTask), one module each in this package: its head,
which loads an encoder as `Stages` (one per layer, as the embedder's) whose `end` turns a packed batch's final states
into one row per input, so an Embedder runs them unchanged, in the same steps and stages as its own rows; what a
row's output becomes; and its `KIND`, the row engine/embed/tasks.py registers (found here by `kinds()`: a new pooling
task is its PoolingTask member and EngineConfig field, engine/config.py, and a module here).

* classify.py: a sequence classifier's label probabilities (PoolingTask.CLASSIFY).
* sparse.py: a SPLADE masked-LM's sparse vector (PoolingTask.SPARSE).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from engine.config import EmbedParams, PoolingTask
from engine.models.stages import Stages


@dataclass(frozen=True, slots=True)
class Head:
    """An encoder with a task head, as an Embedder runs it: its stages, its output width (labels or vocabulary), the
    longest row its positions take, and a classifier's labels (id order) and activation."""
    stages: Stages
    width: int
    max_tokens: int
    labels: tuple[str, ...] = ()
    multi_label: bool = False


class Encoder(Protocol):
    """What a pooling kind reads of a loaded pooling encoder (engine/embed/embedder.py's Embedder; it imports these
    modules, so they name only what they read)."""
    name: str
    labels: tuple[str, ...]
    multi_label: bool
    max_length: int


@dataclass(frozen=True, slots=True)
class PoolingKind:
    task: PoolingTask
    field: str  # the EngineConfig field naming its model, and model_info's key for its id (`<field>_max_tokens` too)
    flag: str  # the `tandem serve` flag that loads it (named where its model is missing or wrong)
    model: str  # what a refusal calls its model
    finish: Callable[["Encoder", torch.Tensor, EmbedParams], list]  # a row's pooled output, as its request asks
    head: Callable[..., Head] | None = None  # loads its head on an encoder (None: the embedder's own pooling)
    labels: bool = False  # model_info lists its labels (`<field>_labels`)


def kinds() -> tuple[PoolingKind, ...]:
    """The `KIND` of every module in this package, PoolingTask order."""
    found = [importlib.import_module(f"{__name__}.{m.name}").KIND for m in pkgutil.iter_modules(__path__)]
    order = list(PoolingTask)
    return tuple(sorted(found, key=lambda k: order.index(k.task)))
