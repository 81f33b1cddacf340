"""Cross-encoder pairs in stages, as embedding rows are (tests/engine/test_embed_stages.py): a pair runs a few layers a
step when a step has no room for it whole, its hidden states in between are kept by the engine's StagedStates (the
forward itself is stateless), and its score is the whole forward's. Fixed step-time coefficients; no wall-clock asserts."""
from __future__ import annotations

import pytest

from engine import RerankParams
from engine.admission import LatencyAdmission
from engine.models.encoder_loader import CrossEncoder
from engine.models.stages import StageWork
from engine.rerank.cross_encoder import CrossEncoderScorer
from engine.step_time import LinearStepTime, StepShape
from tests.engine.conftest import assert_no_leaks, make_llm, record_steps, run_to_end, start_chats
from tests.engine.test_cross_encoder import TINY
from tests.engine.test_latency_objective import COEF, DOCS, GEN, CountingModel
from tests.models.test_modernbert_reranker import _build as build_modernbert

QUERY = "how do bees make honey"


def _staged_equals_whole(ce: CrossEncoder, distinct: bool = True) -> None:
    pairs, _ = CrossEncoderScorer(ce).pairs(QUERY, DOCS[:7], RerankParams(), ce.max_length)
    whole = ce.score([(p.token_ids, p.token_type_ids) for p in pairs])
    done, got = [0] * len(pairs), [None] * len(pairs)
    kept = {}  # each unfinished pair's states between its steps: the caller's, not the cross-encoder's
    while any(d < ce.stages for d in done):
        work, idx = [], []
        for i, p in enumerate(pairs):
            if done[i] < ce.stages:
                stop = min(ce.stages, done[i] + i % 2 + 1)  # pairs at different depths in the same step
                work.append(StageWork(p.token_ids, done[i], stop, p.token_type_ids, state=kept.pop(i, None)))
                idx.append(i)
                done[i] = stop
        for i, result in zip(idx, ce.score_stages(work)):
            assert result.done == (done[i] == ce.stages)
            if result.done:
                got[i] = result.output
            else:
                kept[i] = result.state
    assert not kept
    assert got == pytest.approx(whole, abs=1e-5)
    if distinct:
        assert max(whole) - min(whole) > 1e-4  # the pairs score differently: a mix-up between pairs would show


@pytest.mark.parametrize("family", list(TINY))
def test_bert_family_pairs_in_stages_score_as_the_whole_forward(family, tmp_path):
    ce = CrossEncoder.from_pretrained(TINY[family](tmp_path))
    assert ce.stages == ce.args.num_layers >= 2
    _staged_equals_whole(ce, distinct=False)  # the tiny random heads score these pairs (nearly) alike


def test_minilm_pairs_in_stages_score_as_the_whole_forward(minilm_dir):
    ce = CrossEncoder.from_pretrained(minilm_dir)
    assert ce.stages == 6
    _staged_equals_whole(ce)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_pairs_in_stages_score_as_the_whole_forward(pooling, tmp_path):
    build_modernbert(tmp_path, pooling)
    ce = CrossEncoder.from_pretrained(tmp_path)
    assert ce.stages == 4
    _staged_equals_whole(ce)


def _objective_llm(minilm_dir, headroom_tokens: int):
    target = LinearStepTime(COEF).predict(StepShape(decode_rows=4, cross_encoder_tokens=headroom_tokens))
    llm = make_llm(admission=LatencyAdmission(target, model=CountingModel()),
                   reranker=str(minilm_dir), max_num_batched_tokens=512, num_kv_blocks=512)
    return llm, target


def test_beside_decodes_pairs_too_big_for_the_headroom_run_a_layer_a_step_within_the_target(minilm_dir):
    # ~12 cross-encoder tokens of headroom beside 4 decodes: no ~27-token pair fits whole, one layer of one does.
    llm, target = _objective_llm(minilm_dir, 12)
    engine, records = llm.engine, record_steps(llm)
    start_chats(engine, GEN)
    engine.add_rerank("job", QUERY, DOCS[:3])
    scores = run_to_end(engine)["job"].scores
    assert_no_leaks(llm)  # no pair's states left in the engine's StagedStates either
    decoding = [r for r in records if r.decode_tokens == 4 and r.rerank_pairs]
    assert len(decoding) >= 6 and all(r.rerank_pairs_scored < r.rerank_pairs or r.cross_encoder_tokens < 27
                                      for r in decoding)
    for r in decoding:
        assert r.predicted_s <= target + 1e-12, r
    ce = engine.scorer.encoder
    pairs, _ = engine.scorer.pairs(QUERY, DOCS[:3], RerankParams(), ce.max_length)
    assert scores == pytest.approx(ce.score([(p.token_ids, p.token_type_ids) for p in pairs]), abs=1e-5)


def test_a_rerank_aborted_between_its_pairs_stages_frees_their_kept_states(minilm_dir):
    llm, _ = _objective_llm(minilm_dir, 12)
    engine = llm.engine
    start_chats(engine, GEN)
    engine.add_rerank("job", QUERY, DOCS[:3])
    while not len(engine.staged):
        engine.step()
    assert engine.stats()["staged_bytes"] > 0
    assert engine.abort("job")
    assert len(engine.staged) == 0 and engine.staged.num_bytes == 0
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(llm)


def test_a_pair_preempted_between_its_stages_drops_its_states_and_scores_as_the_whole_forward(minilm_dir):
    llm, _ = _objective_llm(minilm_dir, 12)
    engine = llm.engine
    start_chats(engine, GEN)
    engine.add_rerank("job", QUERY, DOCS[:2])
    while not len(engine.staged):
        engine.step()
    pair = next(s for s in engine.scheduler.running if s in engine.staged)
    assert 0 < pair.stages_done < pair.stages
    engine.scheduler.preempt(pair)
    assert pair not in engine.staged and pair.stages_done == 0
    scores = run_to_end(engine)["job"].scores
    assert_no_leaks(llm)
    ce = engine.scorer.encoder
    pairs, _ = engine.scorer.pairs(QUERY, DOCS[:2], RerankParams(), ce.max_length)
    assert scores == pytest.approx(ce.score([(p.token_ids, p.token_type_ids) for p in pairs]), abs=1e-5)
