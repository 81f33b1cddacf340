"""What a caller asks the engine for: one frozen dataclass per kind of work, and the protocol they share.

A spec is the request as submitted (its id, its inputs, its params), nothing checked or tokenized yet: a plain value.
`LLMEngine.prepare(spec)` turns it into the engine's `Job` (engine/jobs.py) through the builder its kind registers
(engine/kinds.py `build_job`, the one place that dispatches on the kind; each builder lives with its kind), so a
caller (the service's bridge, the offline `LLM`) handles every kind alike and a new kind of work is a new spec here
plus its registered builder, no new entry point above the engine.

The spec also says what a caller's bookkeeping reads before the job exists (its `kind`, how many `completions`
decode side by side, how many `num_inputs` it scores or embeds): this module is the one table of those per kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from engine.config import EmbedParams, RerankParams, SamplingParams
from engine.request import SeqKind


class JobSpec(Protocol):
    """One request of some kind, as submitted: what a caller above the engine reads of it (the engine's intake reads
    the rest)."""
    request_id: str

    @property
    def kind(self) -> SeqKind:
        """What the request is ("generate", "rerank", "embed"): the service's metrics and spans label it so."""

    @property
    def completions(self) -> int:
        """Completions that decode side by side (a generation's n); 1 for every other kind."""

    @property
    def num_inputs(self) -> int:
        """Documents to score or texts to embed; 0 for a generation."""


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """A generation: exactly one of `prompt` (text or token ids) and `messages` (a chat, templated by the engine,
    with the `tools` it may call). `chat`: the prompt is token ids a chat template rendered, so it stops at the
    template's end-of-turn tokens as a request with messages does."""
    request_id: str
    prompt: str | list[int] | None = None
    params: SamplingParams | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    chat: bool = False
    kind: ClassVar[SeqKind] = SeqKind.GENERATE

    @property
    def completions(self) -> int:
        return self.params.n if isinstance(self.params, SamplingParams) else 1

    @property
    def num_inputs(self) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class RerankSpec:
    """A rerank: one pair per document, scored against the query."""
    request_id: str
    query: str
    documents: list[str]
    params: RerankParams | None = None
    kind: ClassVar[SeqKind] = SeqKind.RERANK
    completions: ClassVar[int] = 1

    @property
    def num_inputs(self) -> int:
        return len(self.documents)


@dataclass(frozen=True, slots=True)
class EmbedSpec:
    """An embedding request: one vector per input (texts, or token ids in the embedder's vocabulary); a classification
    (params.task CLASSIFY) may also have text pairs, (text, text_pair), each encoded as the tokenizer encodes a pair."""
    request_id: str
    inputs: list[str | tuple[str, str]] | list[list[int]]
    params: EmbedParams | None = None
    kind: ClassVar[SeqKind] = SeqKind.EMBED
    completions: ClassVar[int] = 1

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)
