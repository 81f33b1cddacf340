"""One generation request in flight (a Job): its n completions, their text streams, and what each step adds."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.detokenizer import TextStream
from engine.jobs import JobContext, RowResult, StepEffects, put_span, queue_time
from engine.outputs import Logprobs, StepOutput, TokenDelta
from engine.request import FinishReason, Sequence, SequenceStatus

log = logging.getLogger("tandem.engine")


@dataclass(slots=True, eq=False)
class Generation:
    """A live generation request: its n completions (sequences, index order) and their text streams."""
    request_id: str
    seqs: list[Sequence]
    streams: list[TextStream]
    num_done: int = 0  # completions that have finished
    first_token_time: float | None = None  # of the request: its first token of any completion
    sent_first: bool = False  # the request's first output went out (it carries prompt_logprobs)
    finish_reasons: list[FinishReason | None] = field(default_factory=list)
    # With prompt_logprobs: completion 0's prompt token log-probabilities from position 1 on, as its chunks compute
    # them, and per position the top alternatives (token id -> raw log-probability).
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finished: bool = False  # its last output went out (every completion done, or it failed)

    @property
    def seq(self) -> Sequence:
        """Completion 0: it prefills the prompt, computes prompt log-probabilities and carries the usage."""
        return self.seqs[0]

    @property
    def completion_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.seqs)

    # ---- the Job protocol ----------------------------------------------------------------------------------------

    @property
    def sequences(self) -> list[Sequence]:
        return self.seqs

    def apply(self, row: Sequence, result: RowResult, effects: StepEffects, ctx: JobContext) -> None:
        """Put the prompt (span) log-probabilities the row's chunk computed; append its sampled token, if any, and
        decide there whether its completion (and the request) stops."""
        if result.span:
            put_span(self.prompt_logprobs, row, result.span)
            if result.top:
                put_span(self.prompt_top_logprobs, row, result.top)
        if result.token is not None:
            effects.outputs.append(self._append(row, result.token, result.logprobs, effects, ctx))

    def final_outputs(self, reason: FinishReason, error: str | None = None) -> list[StepOutput]:
        """Aborted: one output per completion still running, finish reason "abort". Failed: one output, the
        request's."""
        if reason is not FinishReason.ABORT:
            out = self._output(0, self.streams[0].finish(), finished=True, finish_reason=reason, error=error)
            out.queue_time_s = queue_time([self.seq], self.seq.arrival_time)
            return [out]
        outs = [self._output(seq.index, stream.finish(), finish_reason=reason)
                for seq, stream, done in zip(self.seqs, self.streams, self.finish_reasons) if done is None]
        self._close(outs[-1])
        return outs

    # ---- one sampled token ---------------------------------------------------------------------------------------

    def _append(self, seq: Sequence, token: int, logprobs: Logprobs | None, effects: StepEffects,
                ctx: JobContext) -> TokenDelta:
        """One sampled token of one completion: its output, and the request's end when it was the last one."""
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = effects.now
        if self.first_token_time is None:
            self.first_token_time = effects.now
        stream = self.streams[seq.index]
        out = self._output(seq.index, stream.add(token), new_token_ids=[token])
        if seq.params.logprobs is not None:
            out.logprobs = [logprobs if logprobs is not None else {}]
        if not self.sent_first:
            self.sent_first = True
            out.prompt_logprobs = self._prompt_logprobs()
        if seq.grammar is not None and not seq.grammar.accept(token):
            return self._fail(out, f"structured output: the grammar rejected token {token}", effects)
        status = _stop_status(seq, token, stream, ctx)
        if status is None:
            return out
        effects.finished[seq] = status
        out.text += stream.finish()
        out.finish_reason = status.finish_reason
        self.finish_reasons[seq.index] = status.finish_reason
        self.num_done += 1
        if self.num_done == len(self.seqs):
            self._close(out)
        return out

    def _fail(self, out: TokenDelta, message: str, effects: StepEffects) -> TokenDelta:
        """End every completion with an error inside the step (the scheduler lets them go in update)."""
        log.error("request %s failed: %s", self.request_id, message)
        for s in self.seqs:
            if not s.status.finished:
                effects.finished[s] = SequenceStatus.FINISHED_ERROR
        out.finish_reason, out.error = FinishReason.ERROR, message
        self._close(out)
        return out

    def _output(self, index: int, text: str, **fields) -> TokenDelta:
        """Usage is the request's: the prompt once (completion 0's cached tokens), completion tokens summed over n."""
        first = self.seq
        return TokenDelta(request_id=self.request_id, text=text, index=index,
                          completion_tokens=self.completion_tokens, prompt_tokens=first.num_prompt_tokens,
                          cached_tokens=first.num_cached_tokens, first_token_time=self.first_token_time,
                          arrival_time=first.arrival_time, **fields)

    def _close(self, out: TokenDelta) -> None:
        """Make `out` the request's last output."""
        self.finished = out.finished = True
        out.completion_tokens = self.completion_tokens
        out.queue_time_s = queue_time([self.seq], self.seq.arrival_time)

    def _prompt_logprobs(self) -> list[Logprobs | None] | None:
        """One entry per prompt token: None for the first, then the prompt token's raw log-probability followed by
        the top alternatives the runner found (the prompt token is there even when it is not among them)."""
        seq = self.seq
        if seq.num_prompt_logprobs is None:
            return None
        tops = self.prompt_top_logprobs
        out: list[Logprobs | None] = [None]
        for j, value in enumerate(self.prompt_logprobs):
            token = seq.token_ids[j + 1]
            top = tops[j] if j < len(tops) else {}
            out.append({token: value, **{t: v for t, v in top.items() if t != token}})
        return out


def _stop_status(seq: Sequence, token: int, stream: TextStream, ctx: JobContext) -> SequenceStatus | None:
    p = seq.params
    if seq.grammar is not None and seq.grammar.is_terminated():
        return SequenceStatus.FINISHED_STOPPED
    # The first min_tokens tokens never stop a sequence (the sampler masks EOS and stop_token_ids there).
    if seq.num_output_tokens > p.min_tokens and (
            (token in ctx.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids or stream.stopped):
        return SequenceStatus.FINISHED_STOPPED
    if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= ctx.max_model_len:
        return SequenceStatus.FINISHED_LENGTH
    return None
