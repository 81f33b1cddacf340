"""The kinds of work the engine serves, one registered descriptor each: a kind's request kind (SeqKind, which names
its wait queue and, with how a row runs, its price: engine/step_time.py PRICES), its spec (engine/specs.py), the
builder that checks and tokenizes that spec into its job (in the kind's own module), its job class and the type of
the outputs its job hands out. `build_job` is the one dispatch on the kind of a request: `LLMEngine.prepare` and its
callers hand it any spec and never branch on the kind.

Classification and sparse embeddings are embedding jobs on another encoder (EmbedParams.task: their row in
engine/embed/tasks.py), so they are the EMBED kind here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from engine import generation_intake
from engine.embed import intake as embed_intake
from engine.embed.job import EmbedJob
from engine.generation import Generation
from engine.jobs import Job
from engine.outputs import EmbedOutput, RerankOutput, StepOutput, TokenDelta
from engine.request import SeqKind
from engine.rerank import intake as rerank_intake
from engine.rerank.job import RerankJob
from engine.specs import EmbedSpec, GenerateSpec, JobSpec, RerankSpec

if TYPE_CHECKING:
    from engine.intake import RequestIntake


@dataclass(frozen=True, slots=True)
class WorkKind:
    kind: SeqKind
    spec: type
    build: Callable[["RequestIntake", Any], Job]  # the spec checked and tokenized into its job (ValueError naming the field)
    job: type
    output: type[StepOutput]


KINDS: dict[SeqKind, WorkKind] = {k.kind: k for k in (
    WorkKind(SeqKind.GENERATE, GenerateSpec, generation_intake.build, Generation, TokenDelta),
    WorkKind(SeqKind.RERANK, RerankSpec, rerank_intake.build, RerankJob, RerankOutput),
    WorkKind(SeqKind.EMBED, EmbedSpec, embed_intake.build, EmbedJob, EmbedOutput),
)}
_BY_SPEC = {k.spec: k for k in KINDS.values()}


def build_job(intake: "RequestIntake", spec: JobSpec) -> Job:
    """The checked, tokenized job of a request of any kind (not queued): reads the tokenizers and the engine's fixed
    parts only, so any thread may call it. Raises ValueError naming the field (NotLoaded where the engine lacks a
    model), TypeError for a spec no kind registers."""
    kind = _BY_SPEC.get(type(spec))
    if kind is None:
        raise TypeError(f"no intake for a {type(spec).__name__}: the engine takes "
                        f"{', '.join(t.__name__ for t in _BY_SPEC)}")
    return kind.build(intake, spec)
