"""Embedding rows in stages: an encoder row runs a few layers a step when a step has no room for it whole (beside
decodes under a latency objective), its hidden states in between are kept by the engine's StagedStates (the forward
itself is stateless), and the vectors are those of the whole forward. The step-time model is injected with fixed coefficients: what is admitted does not depend on
this machine's speed. No wall-clock asserts."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine import SamplingParams, EmbedParams
from engine.admission import LatencyAdmission
from engine.config import EMBEDDED_EMBEDDER
from engine.embed import Embedder
from engine.models.stages import StageWork
from engine.request import RowExec, SeqKind, Sequence, SequenceStatus
from engine.step_time import LinearStepTime, StepShape
from tests.engine.conftest import assert_no_leaks, make_llm, record_steps, run_to_end, start_chats
from tests.engine.test_embed import TEXTS, _modernbert_dir
from tests.engine.test_embed_objective import EMBED_COEF, EmbedCountingModel
from tests.engine.test_latency_objective import GEN


def _row(n: int, stages: int) -> Sequence:
    return Sequence("r", [0] * n, n, EmbedParams(), 0, 0.0, kind=SeqKind.EMBED, execution=RowExec.ENCODER,
                    stages=stages)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 700), st.integers(1, 24), st.lists(st.integers(0, 700), min_size=1, max_size=40))
def test_a_rows_stages_cost_exactly_its_tokens_and_stages_within_is_the_most_that_fit(n, stages, budgets):
    row, spent = _row(n, stages), 0
    for tokens in budgets:
        if row.stages_done == stages:
            break
        k = row.stages_within(tokens)
        assert row.stage_tokens(k) <= tokens
        if row.stages_done + k < stages:
            assert row.stage_tokens(k + 1) > tokens  # the most that fit
        spent += row.stage_tokens(k)
        row.stages_done += k
    while row.stages_done < stages:
        spent += row.stage_tokens(1)
        row.stages_done += 1
    assert spent == n


def _staged_equals_whole(emb: Embedder, texts: list[str], tol: float) -> None:
    rows = [r.token_ids for r in emb.rows(texts, None, EmbedParams())]
    whole = emb.run(rows, [False] * len(rows))
    # Every row in its own steps: row i runs i % 3 + 1 stages at a time, packed with whichever rows share its stages.
    done = [0] * len(rows)
    got: list[torch.Tensor | None] = [None] * len(rows)
    kept: dict[int, torch.Tensor] = {}  # each unfinished row's states, between its steps: the caller's, not emb's
    while any(d < emb.stages for d in done):
        work, idx = [], []
        for i, r in enumerate(rows):
            if done[i] < emb.stages:
                stop = min(emb.stages, done[i] + i % 3 + 1)
                work.append(StageWork(r, done[i], stop, state=kept.pop(i, None)))
                idx.append(i)
                done[i] = stop
        for i, result in zip(idx, emb.run_stages(work)):
            assert result.done == (done[i] == emb.stages)
            if result.done:
                got[i] = result.output
            else:
                kept[i] = result.state
    assert not kept
    assert (torch.stack(got) - torch.stack(whole)).abs().max().item() <= tol


def test_the_embedded_models_rows_in_stages_give_the_whole_forwards_vectors():
    emb = Embedder.load(EMBEDDED_EMBEDDER)
    assert emb.stages == 6  # one per MiniLM layer
    _staged_equals_whole(emb, TEXTS * 2, 1e-5)


def test_a_modernbert_embedders_rows_in_stages_give_the_whole_forwards_vectors(tmp_path):
    _modernbert_dir(tmp_path)  # 4 layers, local and global attention
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                                    "pooling_mode_mean_tokens": True}))
    emb = Embedder.load(str(tmp_path))
    assert emb.stages == 4
    _staged_equals_whole(emb, TEXTS, 1e-4)


def test_the_staged_forward_keeps_nothing_a_row_brings_its_states_and_gets_them_back():
    emb = Embedder.load(EMBEDDED_EMBEDDER)
    row = emb.rows(TEXTS[:1], None, EmbedParams())[0].token_ids
    first = emb.run_stages([StageWork(row, 0, 2)])[0]
    assert not first.done and first.output is None and first.state.shape[0] == len(row)
    again = emb.run_stages([StageWork(row, 0, 2)])[0]  # the same work twice: the same states (nothing was kept)
    assert torch.equal(first.state, again.state)
    with pytest.raises(ValueError, match="without the states"):
        emb.run_stages([StageWork(row, 2, 4)])  # a later stage needs the states the earlier ones made
    rest = emb.run_stages([StageWork(row, 2, emb.stages, state=first.state)])[0]
    assert rest.done and rest.state is None
    whole = emb.run([row], [False])[0]
    assert (rest.output - whole).abs().max().item() <= 1e-5


def _objective_llm(target_shape: StepShape, **kw):
    target = LinearStepTime(EMBED_COEF).predict(target_shape)
    model = EmbedCountingModel()
    llm = make_llm(admission=LatencyAdmission(target, model=model), embedder=EMBEDDED_EMBEDDER,
                   max_num_batched_tokens=512, num_kv_blocks=512, **kw)
    return llm, model, target


def test_beside_decodes_rows_too_big_for_the_headroom_run_a_layer_a_step_and_every_step_keeps_the_target():
    # The headroom beside 4 decodes is ~12 embedding tokens: no row (20-30 tokens) fits whole, one layer of one does.
    llm, model, target = _objective_llm(StepShape(decode_rows=4, embed_tokens=12))
    engine, records = llm.engine, record_steps(llm)
    start_chats(engine, GEN)
    engine.add_embed("emb", TEXTS)
    finished = run_to_end(engine)
    assert_no_leaks(llm)  # no row's states left in the engine's StagedStates either
    assert len(finished["emb"].embeddings) == len(TEXTS)
    decoding = [r for r in records if r.decode_tokens == 4]
    staged = [r for r in decoding if r.embed_rows]
    assert staged and all(r.embed_rows_done < r.embed_rows or r.embed_tokens < 20 for r in staged)
    assert len(staged) >= 6  # each row's 6 layers over several steps: the rows progressed while the chats decoded
    for r in decoding:
        assert r.predicted_s <= target + 1e-12, r  # a stage rides only within the target
    # the same vectors as alone
    alone = engine.embedder.run([r.token_ids for r in engine.embedder.rows(TEXTS, None, EmbedParams())],
                                [False] * len(TEXTS))
    ours = torch.tensor(finished["emb"].embeddings)
    assert torch.nn.functional.cosine_similarity(ours, torch.stack(alone), dim=-1).min().item() > 0.99999


def test_an_embedding_aborted_between_its_stages_frees_its_kept_states():
    llm, _, _ = _objective_llm(StepShape(decode_rows=4, embed_tokens=12))
    engine = llm.engine
    start_chats(engine, GEN)
    engine.add_embed("emb", TEXTS)
    while not len(engine.staged):  # a row is part-way through its layers
        engine.step()
    assert engine.stats()["staged_bytes"] > 0
    assert engine.abort("emb")
    assert len(engine.staged) == 0 and engine.staged.num_bytes == 0
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(llm)


def test_rows_that_finish_their_stages_leave_no_states_and_the_held_bytes_are_the_rows_states():
    llm, _, _ = _objective_llm(StepShape(decode_rows=4, embed_tokens=12))
    engine = llm.engine
    start_chats(engine, GEN)
    engine.add_embed("emb", TEXTS)
    held = 0
    while engine.has_unfinished():
        engine.step()
        rows = [s for s in engine.scheduler.running if s.kind is SeqKind.EMBED and s.stages_done]
        assert {id(s) for s in rows} == {id(s) for s in engine.scheduler.running if s in engine.staged}
        hidden = engine.embedder.dim * 4  # float32 states, [tokens, dim] per row
        assert engine.staged.num_bytes == sum(s.num_tokens * hidden for s in rows)
        held = max(held, len(engine.staged))
    assert held  # rows were held part-way, and each one's states went with its last stage
    assert_no_leaks(llm)


def test_a_row_preempted_between_its_stages_drops_its_states_and_starts_again_to_the_same_vector():
    llm, _, _ = _objective_llm(StepShape(decode_rows=4, embed_tokens=12))
    engine = llm.engine
    start_chats(engine, GEN)
    engine.add_embed("emb", TEXTS[:1])
    while not len(engine.staged):
        engine.step()
    row = next(s for s in engine.scheduler.running if s.kind is SeqKind.EMBED)
    assert 0 < row.stages_done < row.stages and row in engine.staged
    engine.scheduler.preempt(row)  # what a decode short of a block does to a running sequence
    assert len(engine.staged) == 0 and engine.staged.num_bytes == 0
    assert row.stages_done == 0 and row.status is SequenceStatus.PREEMPTED
    finished = run_to_end(engine)
    assert_no_leaks(llm)
    emb = engine.embedder
    want = Embedder.finish(emb.run([emb.rows(TEXTS[:1], None, EmbedParams())[0].token_ids], [False])[0],
                           EmbedParams())
    got = torch.tensor(finished["emb"].embeddings[0])
    assert torch.nn.functional.cosine_similarity(got, torch.tensor(want), dim=0).item() > 0.99999


@pytest.mark.parametrize("budget", [64, 130])
def test_an_input_longer_than_the_step_budget_runs_in_stages_when_a_layer_of_it_fits(budget):
    llm = make_llm(embedder=EMBEDDED_EMBEDDER, max_num_batched_tokens=budget, num_kv_blocks=64)
    long_text = " ".join(TEXTS * 3)  # ~100-150 tokens: over 64, one layer of it (/6) fits
    got = llm.embed([long_text])[0]
    emb = llm.engine.embedder
    want = Embedder.finish(emb.run([emb.rows([long_text], None, EmbedParams())[0].token_ids], [False])[0],
                           EmbedParams())
    assert torch.nn.functional.cosine_similarity(torch.tensor(got), torch.tensor(want), dim=0).item() > 0.99999
    assert_no_leaks(llm)


def test_embeddings_progress_beside_decodes_while_an_earlier_rerank_job_still_has_pairs_waiting():
    # One scoring queue order (priority, arrival), but each kind is sized and floored on its own: an embedding
    # request behind a long LLM-scored rerank job still gets a layer a step, not a wait for the whole job.
    from tests.engine.test_latency_objective import DOCS

    # LLM-scored pairs (the default mode with an embedder, dense, makes none)
    llm, model, target = _objective_llm(StepShape(decode_rows=4, llm_rerank_tokens=8, embed_tokens=12),
                                        rerank_mode="likelihood")
    engine, records = llm.engine, record_steps(llm)
    start_chats(engine, GEN)
    engine.add_rerank("job", "how do bees make honey", DOCS * 3)
    engine.add_embed("emb", TEXTS[:2])
    order = list(run_to_end(engine))  # ids in the order their requests finished
    assert_no_leaks(llm)
    assert order.index("emb") < order.index("job")  # the later, smaller request was not stuck behind the job
    decoding = [r for r in records if r.decode_tokens == 4]
    # both kinds ride (each its share of the headroom; an embedding stage when its share has saved for one)
    assert sum(bool(r.embed_rows) for r in decoding) >= len(decoding) // 4
    assert sum(bool(r.rerank_tokens) for r in decoding) >= len(decoding) // 2


def test_a_row_the_model_prices_over_the_target_still_rides_a_stage_once_its_share_has_saved_for_it():
    # The model says any embedding costs 50 ms (a slow prior the fitted model has never corrected, because rows never
    # rode beside decodes): no step fits a stage under the target, so each step's share of the headroom is saved in
    # the ledger and the row rides once the savings cover its forward: after ~forward/share steps, not never.
    slow = dict(EMBED_COEF, embed_forward=0.050)
    target = LinearStepTime(slow).predict(StepShape(decode_rows=4)) * 1.2
    model = EmbedCountingModel()
    model.coef = LinearStepTime(slow).coef
    policy = LatencyAdmission(target, model=model)
    llm = make_llm(admission=policy, embedder=EMBEDDED_EMBEDDER, max_num_batched_tokens=512, num_kv_blocks=512)
    engine, records = llm.engine, record_steps(llm)
    start_chats(engine, SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
    engine.add_embed("emb", TEXTS[:1])
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(llm)
    decoding = [r for r in records[1:] if r.decode_tokens]  # (the row's last stages ride after the chats, alone)
    rode = [i for i, r in enumerate(decoding) if r.embed_rows]
    assert rode
    first = decoding[rode[0]]
    decodes = StepShape(first.decode_tokens, first.decode_context_tokens)
    stage = model.predict(StepShape(decodes.decode_rows, decodes.decode_context_tokens,
                                    embed_tokens=1)) - model.predict(decodes)  # the forward's price
    every = stage / (target - model.predict(decodes))  # steps of savings the embedder's forward costs
    assert every > 3  # (the test is about a unit that never fits one step's share)
    assert int(every) - 1 <= rode[0] <= int(every) + 2, (rode, every)  # it rode once its share had saved for it
    # and, its forward paid for, as many of its stages as the savings bought (here all: a stage's tokens are cheap)
    assert sum(r.embed_rows_done for r in decoding) == 1
