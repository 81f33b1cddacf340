"""The latency objective through LLMEngine.step() with the real embedded model: the policy plans with an injected
step-time model (fixed coefficients, so what it admits does not depend on how fast this machine is), the engine feeds
it every StepRecord and records its prediction. No wall-clock asserts."""
from __future__ import annotations

import pytest

from engine import EngineConfig, SamplingParams
from engine.admission import LatencyAdmission
from engine.step_time import LinearStepTime, OnlineStepTime, StepShape
from tests.engine.conftest import assert_no_leaks, make_llm, record_steps

COEF = dict(llm_forward=0.010, decode_rows=0.001, decode_context_tokens=0.0, prefill_tokens=0.0002,
            llm_rerank_tokens=0.0002, cross_encoder_forward=0.002, cross_encoder_tokens=0.0001)
GEN = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# 20 documents: a cross-encoder pair is ~27 tokens, so the headroom (~220 cross-encoder tokens beside 4 decodes)
# takes 8 pairs a step and the job spans at least 3 steps with decodes in every mode.
DOCS = [f"Document {i} says that bees make honey from nectar, and stores it in wax cells number {i}."
        for i in range(20)]


class CountingModel(LinearStepTime):
    """A fixed step-time model that counts what the engine told it."""

    def __init__(self) -> None:
        super().__init__(COEF)
        self.observed: list[tuple[StepShape, float]] = []

    def observe(self, shape: StepShape, seconds: float) -> None:
        self.observed.append((shape, seconds))


def _run(llm, kind_tokens: str, docs: list[str] = DOCS):
    model = llm.engine.scheduler.policy.model
    records = record_steps(llm)
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"chat{i}", f"Tell me about bees, part {i}.", GEN)
    engine.step()  # the prompts, alone
    engine.add_rerank("job", "how do bees make honey", docs)
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(llm)
    return model, records


@pytest.mark.parametrize("mode", ["likelihood", "cross-encoder"])
def test_engine_steps_keep_the_predicted_time_under_the_target(mode, minilm_dir):
    target = LinearStepTime(COEF).predict(StepShape(decode_rows=4, llm_rerank_tokens=60, cross_encoder_tokens=100))
    policy = LatencyAdmission(target, model=CountingModel())
    extra = dict(reranker=str(minilm_dir)) if mode == "cross-encoder" else {}
    llm = make_llm(admission=policy, max_num_batched_tokens=512, num_kv_blocks=512, **extra)
    # 20 documents for the cross-encoder (8 pairs a step); the LLM mode takes 2 pairs a step, so 10 documents span
    # 5 steps with decodes (3 asserted): each is a wide step of the model, and 10 more only added steps
    model, records = _run(llm, mode, DOCS if mode == "cross-encoder" else DOCS[:10])
    mixed = [r for r in records if r.decode_tokens == 4 and r.rerank_pairs]
    assert len(mixed) >= 3
    for r in records:
        if r.num_seqs:
            assert r.predicted_s == pytest.approx(model.predict(StepShape.of_record(r)))
            assert r.target_s == target
        if mode == "cross-encoder":
            assert r.cross_encoder_tokens == r.rerank_tokens
        else:
            assert r.cross_encoder_tokens == 0
        if r.decode_tokens:
            assert r.decode_context_tokens > r.decode_tokens
    for r in mixed:
        assert r.predicted_s <= target or r.rerank_pairs == 1
    assert max(r.rerank_pairs for r in mixed) >= 2  # the headroom, not just the floor
    # The engine fed the model every step that computed something, with the record's own shape and duration.
    computed = [r for r in records if r.num_seqs]
    assert [(s, t) for s, t in model.observed] == [(StepShape.of_record(r), r.duration_s) for r in computed]


def test_tpot_target_ms_runs_the_fitted_model_and_records_its_predictions():
    llm = make_llm(tpot_target_ms=50.0, max_num_batched_tokens=256, num_kv_blocks=512)
    policy = llm.engine.scheduler.policy
    assert isinstance(policy, LatencyAdmission) and isinstance(policy.model, OnlineStepTime)
    _, records = _run(llm, "likelihood")
    assert all(r.predicted_s is not None and r.predicted_s >= 0 for r in records if r.num_seqs)
    assert all(r.target_s == pytest.approx(0.050) for r in records)
    # the planned limit: nothing until the model is ready, then the target less the margin, scaled by the guard (or,
    # in a step whose decodes alone break the target, their step over the decode share: nothing planned under T)
    assert records[0].limit_s == 0.0 and all(r.limit_s is not None and 0 <= r.limit_s for r in records)
    assert all(r.limit_s <= r.target_s for r in records if r.planned)
    assert any(r.limit_s > 0 for r in records)
    assert policy.model.ready and policy.model.num_fits > 0
    assert all(c >= 0 for c in policy.model.coefficients().values())


def test_without_an_objective_records_have_no_prediction():
    assert EngineConfig().tpot_target_ms == "auto"  # the objective is on by default; None turns it off
    llm = make_llm(tpot_target_ms=None)
    records = record_steps(llm)
    llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0.0))
    llm.engine.remove_observer(records.append)
    assert records and all(r.predicted_s is None and r.target_s is None and r.prediction_error is None
                           and r.limit_s is None for r in records)


def test_decode_steps_stay_within_the_target_while_llm_pairs_progress_in_chunks():
    """Query-likelihood pairs of ~170 tokens, each longer than the headroom beside 4 decodes (40 rerank tokens): they
    are prefilled in chunks, every step with decodes stays within the target, and the job moves on in every step."""
    target = LinearStepTime(COEF).predict(StepShape(decode_rows=4, llm_rerank_tokens=40))
    policy = LatencyAdmission(target, model=CountingModel())
    llm = make_llm(admission=policy, max_num_batched_tokens=512, num_kv_blocks=512)
    engine = llm.engine
    records = record_steps(llm)
    # 3 pairs of ~170 tokens at 40 a step: 13 or more steps with decodes (10 asserted), the decodes' 20 tokens
    # outlast them (4 pairs and 40 tokens before: more wide steps, the same assertions)
    gen = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"chat{i}", f"Tell me about bees, part {i}.", gen)
    engine.step()  # the prompts, alone
    docs = [f"Document {i}: " + "worker bees carry nectar to the hive and fan it with their wings, " * 10
            for i in range(3)]
    engine.add_rerank("job", "how do bees make honey", docs)
    scores = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "job" and out.finished:
                scores = out.scores
    assert_no_leaks(llm)
    job_steps = [r for r in records if "job" in r.request_ids]
    with_decodes = [r for r in job_steps if r.decode_tokens == 4]
    assert len(with_decodes) >= 10
    for r in with_decodes:
        assert r.rerank_tokens > 0  # reranking made progress in every step
        assert r.predicted_s <= target + 1e-12  # and the decodes stayed within the target
    assert 38 <= max(r.rerank_tokens for r in with_decodes) <= 40  # the headroom, in chunks: no pair (170+) whole
    alone = make_llm(max_num_batched_tokens=512, num_kv_blocks=512).rerank("how do bees make honey", docs)
    assert scores == pytest.approx(alone, abs=1e-5)
