"""The job protocol (engine/jobs.py), kind by kind: a job's rows, applying each row's result of a step, and its typed
final output, without a model (the runner's results are handed in as RowResults, as the engine hands them)."""
from __future__ import annotations

import math

import pytest
import torch

from engine.config import EmbedParams, RerankParams, SamplingParams
from engine.detokenizer import TextStream
from engine.embed import EmbedJob
from engine.generation import Generation
from engine.jobs import Job, JobContext, RowResult, StepEffects
from engine.outputs import EmbedOutput, RerankOutput, TokenDelta
from engine.request import FinishReason, RerankPair, RowExec, SeqKind, Sequence, SequenceStatus
from engine.rerank import RerankJob


class FakeScorer:
    """A rerank mode's two answers: a pair's score (its last position's, else its span's sum) and the request's."""

    def __init__(self, chosen: list[int] | None = None) -> None:
        self.vectors_seen = None
        self._chosen = chosen or []

    def pair_score(self, last, span):
        return last if last is not None else sum(span)

    def request_scores(self, pair_scores, vectors):
        self.vectors_seen = vectors
        return [10 * s if s is not None else 0.0 for s in pair_scores]

    def chosen(self, vectors):
        self.vectors_seen = vectors
        return self._chosen


def _row(rid, tokens, kind=SeqKind.GENERATE, **kw) -> Sequence:
    params = {SeqKind.GENERATE: kw.pop("params", None), SeqKind.RERANK: RerankParams(),
              SeqKind.EMBED: EmbedParams()}[kind]
    seq = Sequence(rid, list(tokens), len(tokens), params, 0, 10.0, kind=kind, **kw)
    seq.status = SequenceStatus.RUNNING
    return seq


def _ctx(tokenizer=None, scorer=None) -> JobContext:
    eos = {tokenizer.eos_token_id} if tokenizer is not None else set()
    return JobContext(scorer or FakeScorer(), eos, 2048)


def _step(job: Job, results: list[tuple[Sequence, RowResult]], ctx: JobContext) -> StepEffects:
    effects = StepEffects(now=11.0)
    for row, result in results:
        job.apply(row, result, effects, ctx)
    return effects


def _generation(tokenizer, n: int, max_tokens: int) -> Generation:
    params = SamplingParams(max_tokens=max_tokens, n=n)
    seqs = [_row("g", [1, 2, 3], params=params, index=i) for i in range(n)]
    return Generation("g", seqs, [TextStream(tokenizer) for _ in seqs], finish_reasons=[None] * n)


def test_a_generation_streams_token_deltas_and_ends_with_its_last_completion(tokenizer):
    gen = _generation(tokenizer, n=2, max_tokens=3)
    gen.seq.first_scheduled_time = 10.5
    ctx = _ctx(tokenizer)
    assert gen.sequences == gen.seqs and all(s.execution is RowExec.CAUSAL for s in gen.sequences)
    words = tokenizer(" the quick brown fox", add_special_tokens=False).input_ids
    first = _step(gen, [(s, RowResult(3, token=words[i])) for i, s in enumerate(gen.seqs)], ctx)
    assert [type(o) for o in first.outputs] == [TokenDelta, TokenDelta]
    assert [(o.index, o.new_token_ids, o.finished) for o in first.outputs] == [(0, [words[0]], False),
                                                                              (1, [words[1]], False)]
    assert first.outputs[1].completion_tokens == 2 and first.outputs[0].prompt_tokens == 3 and not first.finished
    # completion 0 stops at EOS; completion 1 runs to max_tokens and ends the request
    second = _step(gen, [(gen.seqs[0], RowResult(1, token=tokenizer.eos_token_id)),
                         (gen.seqs[1], RowResult(1, token=words[2]))], ctx)
    assert second.finished == {gen.seqs[0]: SequenceStatus.FINISHED_STOPPED}
    assert second.outputs[0].finish_reason is FinishReason.STOP and not second.outputs[0].finished
    assert not gen.finished
    last = _step(gen, [(gen.seqs[1], RowResult(1, token=words[3]))], ctx)
    out = last.outputs[0]
    assert last.finished == {gen.seqs[1]: SequenceStatus.FINISHED_LENGTH}
    assert out.finished and out.finish_reason is FinishReason.LENGTH and gen.finished
    assert out.completion_tokens == 5 and out.queue_time_s == pytest.approx(0.5)
    streamed = first.outputs[1].text + second.outputs[1].text + out.text
    assert streamed == tokenizer.decode([words[1], words[2], words[3]])


def test_a_generation_row_without_a_token_only_accumulates_its_prompt_logprobs(tokenizer):
    gen = _generation(tokenizer, n=1, max_tokens=4)
    gen.seq.logprob_start = 1
    effects = _step(gen, [(gen.seq, RowResult(2, span=[-0.5]))], _ctx(tokenizer))
    assert effects.outputs == [] and effects.finished == {} and gen.prompt_logprobs == [-0.5]


def test_an_aborted_generation_ends_each_running_completion(tokenizer):
    gen = _generation(tokenizer, n=3, max_tokens=8)
    ctx = _ctx(tokenizer)
    _step(gen, [(s, RowResult(3, token=100 + i)) for i, s in enumerate(gen.seqs)], ctx)
    _step(gen, [(gen.seqs[1], RowResult(1, token=tokenizer.eos_token_id))], ctx)  # completion 1 is done
    outs = gen.final_outputs(FinishReason.ABORT)
    assert [type(o) for o in outs] == [TokenDelta, TokenDelta]
    assert [o.index for o in outs] == [0, 2] and all(o.finish_reason is FinishReason.ABORT for o in outs)
    assert [o.finished for o in outs] == [False, True]
    failed = _generation(tokenizer, n=2, max_tokens=8).final_outputs(FinishReason.ERROR, "boom")
    assert len(failed) == 1 and failed[0].finished and failed[0].error == "boom"


def _pair(i: int, tokens: int, **kw) -> Sequence:
    return _row("r", range(tokens), SeqKind.RERANK, pair=RerankPair(i), **kw)


def _rerank(pairs, documents=("a", "b"), **kw) -> RerankJob:
    n = len(documents)
    return RerankJob("r", "q", list(documents), RerankParams(), 10.0, pairs=list(pairs), scores=[None] * n,
                     span_logprobs=[[] for _ in range(n)], remaining=len(pairs), document_tokens=[3, 4],
                     truncated=[False, True], windows=[1, 1], **kw)


def test_a_rerank_job_scores_each_pair_at_its_last_chunk_and_ends_with_its_scores():
    chunked, whole = _pair(0, 5, logprob_start=3), _pair(1, 4)
    job = _rerank([chunked, whole])
    ctx = _ctx()
    assert job.sequences == [chunked, whole]
    effects = _step(job, [(chunked, RowResult(3, span=[-1.0]))], ctx)  # positions 0-2 of 5: not its last chunk
    assert effects.finished == {} and effects.outputs == []
    chunked.num_computed_tokens = 3  # what the scheduler's update does after the step
    effects = _step(job, [(chunked, RowResult(2, span=[-2.0])), (whole, RowResult(4, score=0.25))], ctx)
    assert effects.finished == {chunked: SequenceStatus.FINISHED_STOPPED, whole: SequenceStatus.FINISHED_STOPPED}
    [out] = effects.outputs
    assert isinstance(out, RerankOutput) and out.finished and out.finish_reason is FinishReason.STOP
    assert out.scores == [-30.0, 2.5]  # the scorer's request scores of the pair scores (-1 - 2, 0.25)
    assert (out.document_tokens, out.truncated, out.windows) == ([3, 4], [False, True], [1, 1])
    assert out.prompt_tokens == 9 and job.finished


def test_a_cascade_queues_the_pairs_its_scorer_chooses_once_the_embedder_rows_are_in():
    rows = [_row("r", range(4), SeqKind.EMBED, execution=RowExec.ENCODER, stages=2, index=i) for i in range(3)]
    held = [_pair(0, 4), _pair(1, 4)]
    scorer = FakeScorer(chosen=[1])
    job = _rerank([], rows=rows, vectors=[None] * 3, held=held)
    job.remaining = len(rows)
    ctx = _ctx(scorer=scorer)
    assert job.sequences == rows  # the held pairs are not queued yet
    effects = _step(job, [(rows[0], RowResult(2, stages=(0, 1)))], ctx)  # one of its two stages: no vector yet
    assert effects.finished == {}
    vectors = [torch.full((2,), float(i + 1)) for i in range(3)]
    effects = _step(job, [(r, RowResult(4, stages=(0, 2), vector=v)) for r, v in zip(rows, vectors)], ctx)
    assert effects.queued == [held[1]] and effects.outputs == [] and not job.finished
    assert all(a is b for a, b in zip(scorer.vectors_seen, vectors)) and set(effects.finished) == set(rows)
    effects = _step(job, [(held[1], RowResult(4, score=0.5))], ctx)
    assert effects.outputs[0].scores == [0.0, 5.0] and job.finished


def test_an_embed_job_finishes_each_vector_and_ends_with_them_in_input_order():
    rows = [_row("e", range(3), SeqKind.EMBED, execution=RowExec.ENCODER, stages=6, index=i) for i in range(2)]
    job = EmbedJob("e", EmbedParams(), 10.0, rows=rows, vectors=[None, None], remaining=2, truncated=[True, False])
    ctx = _ctx()
    assert job.sequences == rows
    effects = _step(job, [(rows[1], RowResult(2, stages=(0, 3)))], ctx)  # three of six stages
    assert effects.finished == {} and effects.outputs == []
    effects = _step(job, [(rows[1], RowResult(1, stages=(3, 6), vector=torch.tensor([3.0, 4.0])))], ctx)
    assert effects.finished == {rows[1]: SequenceStatus.FINISHED_STOPPED} and effects.outputs == []
    effects = _step(job, [(rows[0], RowResult(3, stages=(0, 6), vector=torch.tensor([0.0, 2.0])))], ctx)
    [out] = effects.outputs
    assert isinstance(out, EmbedOutput) and out.finished and job.finished
    assert out.embeddings[0] == [0.0, 1.0] and all(math.isclose(a, b, rel_tol=1e-6)
                                                   for a, b in zip(out.embeddings[1], [0.6, 0.8]))
    assert out.truncated == [True, False] and out.prompt_tokens == 6


@pytest.mark.parametrize("make", ["rerank", "embed"])
def test_an_ended_scoring_job_carries_no_results(make):
    job = _rerank([_pair(0, 4)]) if make == "rerank" else EmbedJob("e", EmbedParams(), 10.0, remaining=1)
    [out] = job.final_outputs(FinishReason.ABORT)
    assert out.finished and out.finish_reason is FinishReason.ABORT
    assert (out.scores if make == "rerank" else out.embeddings) is None and out.truncated is None
