"""One embedding request in flight: its inputs, one encoder row per input, vectors as they arrive."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EmbedParams
from engine.embed.embedder import Embedder
from engine.jobs import JobContext, RowResult, StepEffects, queue_time
from engine.outputs import EmbedOutput
from engine.request import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True, eq=False)
class EmbedJob:
    request_id: str
    params: EmbedParams
    arrival_time: float
    rows: list[Sequence] = field(default_factory=list)  # one per input, input order (Sequence.index)
    vectors: list[list[float] | None] = field(default_factory=list)  # engine.py fills them as rows run
    remaining: int = 0
    truncated: list[bool] = field(default_factory=list)  # per input: cut to the embedder's limit
    finished: bool = False  # its output went out (every row ran)

    # ---- the Job protocol ----------------------------------------------------------------------------------------

    @property
    def sequences(self) -> list[Sequence]:
        return self.rows

    def apply(self, row: Sequence, result: RowResult, effects: StepEffects, ctx: JobContext) -> None:
        """An input's vector once its row's last stage ran, finished per the request's params; the job ends with
        the last one."""
        if result.vector is None:
            return  # some of the row's stages ran: the rest come in later steps
        effects.finished[row] = SequenceStatus.FINISHED_STOPPED
        encoder = ctx.poolers.get(self.params.task)  # the encoder of its task (none given: a plain embedding)
        self.vectors[row.index] = (encoder.finish_row(result.vector, self.params) if encoder is not None
                                   else Embedder.finish(result.vector, self.params))
        self.remaining -= 1
        if not self.remaining:
            self.finished = True
            effects.outputs.extend(self.final_outputs(FinishReason.STOP))

    def final_outputs(self, reason: FinishReason, error: str | None = None) -> list[EmbedOutput]:
        """Its one output: the vectors (per input, input order) when it finished with "stop"."""
        done = reason is FinishReason.STOP
        return [EmbedOutput(self.request_id, finished=True, finish_reason=reason, error=error,
                            embeddings=list(self.vectors) if done else None,
                            truncated=list(self.truncated) if done else None, prompt_tokens=self.prompt_tokens,
                            arrival_time=self.arrival_time, queue_time_s=queue_time(self.rows, self.arrival_time))]

    @property
    def prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.rows)
