"""What a request's `model` may name, and which model does each kind of work (the task policy): pure functions of
what the replica serves (`ModelInfo`), the names it also answers to (`accepted`) and whether names are strict.

The core API checks every request through these before it reaches the engine, so a request is refused the same way
through either door; `/v1/models` and gRPC `ModelInfo.models` list `served_models`.
"""
from __future__ import annotations

import os

from service.core_types import ModelInfo, ServedModel
from service.errors import ErrorKind, ServiceError, invalid
from service.kinds import KINDS, Task, pooled

# The rerank modes the LLM scores in (engine RerankMode values), alone or beside the embedder; the embedder's cosine
# scores in dense, fusion and cascade.
_LLM_SCORES = ("likelihood", "judge", "fusion", "cascade")
_EMBEDDER_SCORES = ("dense", "fusion", "cascade")
EMBEDDED_SUFFIX = " (embedded)"  # how engine.model_info() names the embedded model


def short_name(model: str) -> str:
    """A model's default id: a GGUF file's stem, a directory's name, the embedded model's name."""
    if model.endswith(EMBEDDED_SUFFIX):
        return model[:-len(EMBEDDED_SUFFIX)]
    path = model.rstrip("/")
    name = os.path.basename(path) or path
    return name[:-len(".gguf")] if name.lower().endswith(".gguf") else name


def rerank_model(info: ModelInfo) -> str:
    """The cross-encoder's id ("" in the other modes: the embedder, the LLM or both score reranks then)."""
    return short_name(info.reranker) if info.rerank_mode == "cross-encoder" else ""


def rerank_name(info: ModelInfo) -> str:
    """The id of what scores reranks, as responses and the access log name it: the cross-encoder's, the embedder's
    (dense), the LLM's served name (likelihood, judge), or both (`all-MiniLM-L6-v2+SmolLM2-135M-Instruct`: fusion and
    cascade)."""
    if info.rerank_mode == "cross-encoder":
        return rerank_model(info)
    if info.rerank_mode == "dense":
        return info.embedder
    if info.rerank_mode in ("fusion", "cascade"):
        return f"{info.embedder}+{info.model}"
    return info.model


def served_models(info: ModelInfo) -> list[ServedModel]:
    """Each model this replica serves with what it does: the LLM's names generate (and rerank in the modes it scores
    in), the embedder embeds (and reranks in the modes its cosine scores in), each kind with an encoder of its own
    (a classifier, a sparse embedder) its model, a cross-encoder reranks."""
    mode = info.rerank_mode
    llm = (Task.GENERATE, Task.RERANK) if mode in _LLM_SCORES else (Task.GENERATE,)
    out = {name: ServedModel(name, llm, info.max_model_len) for name in info.served_names}
    if info.embedder:
        tasks = (Task.EMBED, Task.RERANK) if mode in _EMBEDDER_SCORES else (Task.EMBED,)
        out.setdefault(info.embedder, ServedModel(info.embedder, tasks, info.embedder_max_tokens))
    for kind in pooled():
        encoder = info.encoder(kind.task)
        if encoder.name:
            out.setdefault(encoder.name, ServedModel(encoder.name, (kind.task,), encoder.max_tokens))
    cross_encoder = rerank_model(info)
    if cross_encoder:
        out.setdefault(cross_encoder, ServedModel(cross_encoder, (Task.RERANK,), info.rerank_max_pair_tokens))
    return list(out.values())


def known(info: ModelInfo, accepted: set[str], model: str) -> tuple[Task, ...] | None:
    """What the model a request names does; None: no model of this replica (an alias of the LLM, the path as given,
    counts as the LLM)."""
    tasks = {m.name: m.tasks for m in served_models(info)}
    if model in tasks:
        return tasks[model]
    return tasks[info.model] if model and model in accepted else None


def check_task(info: ModelInfo, accepted: set[str], strict: bool, model: str, task: Task) -> None:
    """A request naming a model this replica serves for something else (an embedding sent to the chat model's name, a
    chat to the embedder's) is refused, never served by another model under the name it gave: 400 naming the models
    that do its kind. Backwards compatible: a kind with `llm_alias` (a rerank) naming the LLM where the LLM does not
    do it is served by the model that does (/v1/models listed the LLM as a reranker until issue 72), unless names are
    strict."""
    does = known(info, accepted, model)
    if does is None or task in does:
        return
    if KINDS[task].llm_alias and any(KINDS[t].decodes for t in does) and not strict:
        return
    raise invalid(f"model {model!r} does not {KINDS[task].verb}: it is served to "
                  f"{' and '.join(KINDS[t].verb for t in does)}; {_who(info, task)}")


def _who(info: ModelInfo, task: Task) -> str:
    """Which models do `task`, for a refusal."""
    able = [m.name for m in served_models(info) if task in m.tasks]
    if not able:
        return "this replica serves none that does"
    return f"send it to {' or '.join(repr(n) for n in able)} (or leave model empty)"


def check_served(info: ModelInfo, accepted: set[str], strict: bool, model: str, task: Task) -> None:
    """A request of a kind other than generation naming no model of this replica is served by the one that does its
    kind anyway (as TEI does), unless names are strict: then NOT_FOUND naming the models that do."""
    if strict and model and known(info, accepted, model) is None:
        able = [m.name for m in served_models(info) if task in m.tasks]
        raise ServiceError(ErrorKind.NOT_FOUND, f"model {model!r} is not served by this replica; it serves "
                                                f"{able} for {KINDS[task].verb} (leave model empty for it)")
