"""LatencyAdmission (the --tpot-target-ms objective) in the scheduler simulator, on a fake clock: a step's "duration" is
what a known linear step-time model (TRUE) says it costs, so nothing here runs a model or reads a clock.

The policy plans either with TRUE itself (a fake, fixed step-time model: admissions must be exactly the most that
keep the prediction under the target) or with the OnlineStepTime it would use in production, fed the fake durations
(it must converge to the same admissions, and shrug off a step that ran 10x long).
"""
from __future__ import annotations


import pytest

from engine.admission import LatencyAdmission, ShareAdmission, policy_for
from engine.cadence import CadenceGuard
from engine.config import EngineConfig
from engine.outputs import StepRecord
from engine.request import SeqKind, SequenceStatus
from engine.step_time import TokenKind, LinearStepTime, OnlineStepTime, StepShape
from tests.engine.test_scheduler import Sim, decode_ids, toks

# Seconds: an LLM forward costs 10 ms, each decode row 1 ms, prompt and LLM-scored pair tokens 0.2 ms, a cross-encoder
# forward 2 ms plus 0.1 ms a token.
TRUE = dict(llm_forward=0.010, decode_rows=0.001, decode_context_tokens=0.0, prefill_tokens=0.0002,
            llm_rerank_tokens=0.0002, cross_encoder_forward=0.002, cross_encoder_tokens=0.0001)
T = 0.0205  # 4 decodes: 14 ms, so 6.5 ms of headroom: 45 cross-encoder tokens after its 2 ms forward, 32 LLM tokens


def record_of(batch, seconds: float, predicted: float | None = None, start: float = 0.0) -> StepRecord:
    return StepRecord(step=0, start_time=start, duration_s=seconds, decode_tokens=batch.num_decode_tokens,
                      cached_tokens=0, tokens=batch.tokens, rows=batch.rows, rows_done=batch.rows_done,
                      num_seqs=len(batch), budget=0, kv_blocks_total=1,
                      kv_blocks_free=1, kv_blocks_cached=0, preempted=0, num_running=0, num_waiting=0,
                      request_ids=[], decode_context_tokens=batch.num_decode_context_tokens, predicted_s=predicted,
                      target_s=batch.target_s, limit_s=batch.limit_s, planned=batch.planned, owed=batch.owed)


class ClockSim(Sim):
    """The simulator plus the engine's part in the objective: each step takes TRUE's time (times `slow[step]`), and
    the policy observes the record, as LLMEngine does after every step."""

    def __init__(self, policy: LatencyAdmission, slow: dict[int, float] | None = None, **kw) -> None:
        kw = dict(num_blocks=1024, budget=256, block_size=4, max_seqs=32) | kw
        super().__init__(admission=policy, **kw)
        self.policy = policy
        self.true = LinearStepTime(TRUE)
        self.slow = slow or {}
        self.seconds: list[float] = []
        self.predicted: list[float] = []
        self.clock = 0.0  # steps run back to back on the fake clock

    def step(self):
        batch = super().step()
        predicted = self.policy.predict(batch)
        seconds = self.true.predict(StepShape.of_batch(batch)) * self.slow.get(self.steps, 1.0)
        self.predicted.append(predicted)
        self.seconds.append(seconds)
        self.policy.observe(record_of(batch, seconds, predicted, self.clock))
        self.clock += seconds
        return batch


def chats(sim: Sim, n: int = 4, max_tokens: int = 200, priority: int = 0) -> list:
    return [sim.add(f"chat{i}", toks(3, 10 * i), max_tokens=max_tokens, priority=priority) for i in range(n)]


def xenc_flood(sim: Sim, rid: str = "flood", n: int = 200, tokens: int = 10, priority: int = 0) -> list:
    return sim.add_rerank_job(rid, [], [toks(tokens, 5000 + tokens * i) for i in range(n)], priority=priority,
                              uses_kv=False)


def most_pairs(decodes: int, pair_tokens: int, kind: str = "cross_encoder_tokens", target: float = T) -> int:
    """The most whole pairs of `pair_tokens` whose true step time, beside `decodes` decode rows, stays <= target."""
    true = LinearStepTime(TRUE)
    k = 0
    while true.predict(StepShape(decode_rows=decodes, **{kind: (k + 1) * pair_tokens})) <= target:
        k += 1
    return k


def pairs_in(batch) -> int:
    return sum(s.kind is SeqKind.RERANK for s in batch.seqs)


def flood_steps(sim: Sim) -> list[int]:
    """Indices of the steps that ran the 4 steady decodes beside rerank pairs."""
    return [i for i, b in enumerate(sim.batches) if b.num_decode_tokens == 4 and b.num_rerank_pairs]


# ---- a fixed (fake) step-time model ------------------------------------------------------------------------------


def test_steady_decodes_and_a_flood_get_the_most_pairs_that_keep_the_prediction_under_the_target():
    policy = LatencyAdmission(T, model=LinearStepTime(TRUE))
    sim = ClockSim(policy)
    chats(sim)
    xenc_flood(sim)
    for _ in range(30):
        sim.step()
    steady = flood_steps(sim)
    assert len(steady) >= 25
    best = most_pairs(4, 10)
    assert best == 4
    for i in steady:
        assert pairs_in(sim.batches[i]) == best
        assert sim.predicted[i] <= T and sim.seconds[i] <= T
    sim.run()


def test_llm_scored_pairs_are_costed_as_llm_tokens():
    """Pairs that run in the LLM forward (likelihood, judge) cost 0.2 ms a token and no second forward."""
    policy = LatencyAdmission(T, model=LinearStepTime(TRUE))
    sim = ClockSim(policy)
    chats(sim)
    sim.add_rerank_job("llm", [], [toks(8, 5000 + 8 * i) for i in range(200)], uses_kv=True)
    for _ in range(30):
        sim.step()
    best = most_pairs(4, 8, "llm_rerank_tokens")
    assert best == 4  # 32 tokens in 6.5 ms
    steady = [i for i in flood_steps(sim) if i > 3]
    assert steady and all(pairs_in(sim.batches[i]) == best and sim.predicted[i] <= T for i in steady)
    sim.run()


def test_with_no_decodes_and_no_deadlines_rerank_takes_the_whole_budget_as_without_an_objective():
    """(With deadlines and a quantum, overhead_share, a step with no decodes is held to it instead:
    tests/engine/test_deadlines.py.)"""
    def batches(admission):
        sim = Sim(num_blocks=512, budget=256, block_size=4, max_seqs=8, admission=admission)
        sim.add_rerank_job("flood", toks(8, 500), [toks(4, 1000 + 4 * i) for i in range(100)])
        sim.add_rerank_job("ce", [], [toks(40, 3000 + 40 * i) for i in range(30)], uses_kv=False)
        sim.run()
        return [[s.request_id for s in b.seqs] for b in sim.batches]

    objective = batches(LatencyAdmission(0.001, model=LinearStepTime(TRUE), stretch=None))  # a target no step meets
    assert objective == batches(ShareAdmission())
    assert max(map(len, objective)) == 8  # every seat


def share_of(sim: Sim, kind: str, steps: range) -> float:
    """The share of the steps' true time that `kind`'s tokens took, priced beside each step's decodes."""
    true, spent, total = sim.true, 0.0, 0.0
    for i in steps:
        shape = StepShape.of_batch(sim.batches[i])
        decodes = StepShape(shape.decode_rows, shape.decode_context_tokens)
        if getattr(shape, kind):  # its part of the step's true price, of the step's time (a slowed step's too)
            part = true.predict(decodes.with_tokens(TokenKind(kind), getattr(shape, kind))) - true.predict(decodes)
            spent += part / true.predict(shape) * sim.seconds[i]
        total += sim.seconds[i]
    return spent / total


def test_a_fixed_target_the_decodes_alone_break_leaves_the_others_their_automatic_share():
    """The decodes alone are over the target (4 decodes: 14 ms, T = 5 ms): T cannot be held, so the shares hold as
    under the automatic target: LLM-scored pairs get a quarter of every step (14 ms / 0.75 = 18.7 ms a step), in
    chunks, and nothing is 'planned' (the cadence guard does not judge these steps)."""
    policy = LatencyAdmission(0.005, model=LinearStepTime(TRUE))
    sim = ClockSim(policy)
    chats(sim, max_tokens=80)
    sim.step()
    pairs = sim.add_rerank_job("llm", toks(6, 900), [toks(20, 5000 + 20 * i) for i in range(40)])
    for _ in range(30):
        batch = sim.step()
        if batch.num_decode_tokens == 4 and batch.num_rerank_tokens:  # the share, and at most its saved remainder
            assert not batch.planned and sim.predicted[-1] <= 0.014 / 0.75 + 0.0002 + 1e-9
    assert not pairs[-1].status.finished
    during = [i for i, b in enumerate(sim.batches) if i > 1 and b.num_decode_tokens == 4]
    assert sum(bool(sim.batches[i].num_rerank_tokens) for i in during) >= 0.8 * len(during)
    assert share_of(sim, "llm_rerank_tokens", range(during[0], during[-1] + 1)) == pytest.approx(0.25, rel=0.1)
    sim.run()
    assert all(p.status is SequenceStatus.FINISHED_STOPPED for p in pairs)


@pytest.mark.parametrize("decodes, chunk", [(8, 8), (12, 4), (2, 14)])
def test_a_share_of_chunks_keeps_the_step_on_the_narrow_path(decodes, chunk):
    """Past 16 LLM rows the forward goes wide (a fixed 10 ms here). A chunked pair's share that would cross the
    threshold is cut to the rows left under it (8 decodes: 8 tokens, not the 30 their share would buy wide)."""
    wide = LinearStepTime({**TRUE, "wide_forward": 0.010}, wide_rows=16)
    policy = LatencyAdmission(model=wide)
    sim = ClockSim(policy, max_seqs=64)
    sim.true = wide
    chats(sim, n=decodes, max_tokens=80)
    sim.step()
    sim.add_rerank_job("llm", toks(6, 900), [toks(40, 5000 + 40 * i) for i in range(4)])
    steps = [sim.step() for _ in range(30)]
    chunks = [b.num_rerank_tokens for b in steps if b.num_decode_tokens == decodes and b.num_rerank_tokens]
    assert max(chunks) == chunk and chunks.count(chunk) >= 3  # less only where a pair ends
    sim.run()


def test_a_unit_larger_than_its_share_rides_when_the_ledger_saved_for_it():
    """Cross-encoder pairs of 30 tokens (5 ms) beside 4 decodes (14 ms) under the automatic target: a step's share for
    them is 4.67 ms, less than one pair, so no step fits one under its limit. The ledger keeps what each step owed
    them and a pair rides once it covers one: over a long run they get their quarter of the time (within 10%)."""
    policy = LatencyAdmission(model=LinearStepTime(TRUE))
    sim = ClockSim(policy)
    chats(sim, max_tokens=200)
    sim.step()
    pairs = xenc_flood(sim, n=150, tokens=30)
    for _ in range(150):
        sim.step()
    during = [i for i, b in enumerate(sim.batches) if i > 2 and b.num_decode_tokens == 4]
    assert len(during) >= 140
    rode = [pairs_in(sim.batches[i]) for i in during]
    assert 0 in rode and max(rode) >= 1  # steps without a pair, and pairs
    assert share_of(sim, "cross_encoder_tokens", range(during[0], during[-1] + 1)) == pytest.approx(0.25, rel=0.1)
    sim.run()
    assert all(p.status.finished for p in pairs)


def embed_flood_beside_chats(policy: LatencyAdmission, prices: dict, rows: int, max_tokens: int, **kw):
    """4 chats decoding on the fake clock priced by `prices`, then `rows` embedding rows of 60 tokens in 6 stages."""
    sim = ClockSim(policy, **kw)
    sim.true = LinearStepTime(prices)
    chats(sim, max_tokens=max_tokens)
    sim.step()
    return sim, [sim.add_embed(f"emb/{i}", toks(60, 9000 + 60 * i), stages=6) for i in range(rows)]


@pytest.mark.parametrize("decode_share", [0.5, 0.75, 0.9])
def test_with_a_share_set_the_scoring_rows_get_that_share_of_a_long_run(decode_share):
    """Embedding rows of 6 stages each beside 4 steady decodes under the automatic target: across a long run of mixed
    steps the rows take 1 - decode_share of the time, within 10%, and the decodes the rest."""
    prices = {**TRUE, "embed_forward": 0.001, "embed_tokens": 0.0001}
    policy = LatencyAdmission(model=LinearStepTime(prices), decode_share=decode_share)
    sim, rows = embed_flood_beside_chats(policy, prices, 1000, max_tokens=300)
    for _ in range(200):
        sim.step()
    during = range(3, 200)
    assert all(sim.batches[i].num_decode_tokens == 4 for i in during)
    assert share_of(sim, "embed_tokens", during) == pytest.approx(1 - decode_share, rel=0.1)
    assert not all(r.status.finished for r in rows)  # still a flood: the share, not the whole step


def test_under_the_automatic_target_a_chats_prompt_comes_on_top_of_the_rerank_share():
    """Under the automatic target a chat's prompt is the chats' own time (the chat waiting to join is already a decode
    row of T): while a late chat's 400-token prompt is chunked beside 4 decodes, the embedding flood still gets all
    the time T leaves beside the decodes, as with no prompt waiting (not half of it, as two kinds of equal weight),
    and the prompt its weight's part of that time on top, every step until it is done."""
    prices = {**TRUE, "embed_forward": 0.001, "embed_tokens": 0.0001}
    policy = LatencyAdmission(model=LinearStepTime(prices))
    sim, rows = embed_flood_beside_chats(policy, prices, 1000, max_tokens=300)
    for _ in range(10):
        sim.step()
    late = sim.add("late", toks(400, 7000), max_tokens=2)
    during, taken = [], []
    while late.num_output_tokens == 0:
        batch = sim.step()
        n = sum(k for s, k in zip(batch.seqs, batch.num_new_tokens) if s is late)
        if n and late.num_output_tokens == 0:  # a chunk, not the last
            during.append(len(sim.batches) - 1)
            taken.append(n)
    assert len(during) >= 5 and all(taken)
    true = sim.true
    embed_s = free_s = 0.0
    for i in during:
        batch = sim.batches[i]
        shape = StepShape.of_batch(batch)
        decodes = StepShape(shape.decode_rows, shape.decode_context_tokens)
        assert shape.decode_rows == 4
        embed_s += true.predict(decodes.with_tokens(TokenKind.EMBED, shape.embed_tokens)) - true.predict(decodes)
        free_s += batch.target_s - true.predict(decodes)
        assert sim.predicted[i] > batch.target_s  # the prompt rode on top of T
    assert embed_s / free_s == pytest.approx(1.0, rel=0.1)
    assert not all(r.status.finished for r in rows)  # still a flood: the share, not the whole step


def test_with_nothing_else_waiting_a_kind_takes_the_whole_step():
    """Work-conserving: with decodes and no other kind waiting, embedding rows take the whole share the step leaves
    (with no decodes at all, any kind takes the whole budget: the test above with no decodes)."""
    prices = {**TRUE, "embed_forward": 0.001, "embed_tokens": 0.0001}
    policy = LatencyAdmission(model=LinearStepTime(prices))
    sim, _ = embed_flood_beside_chats(policy, prices, 200, max_tokens=100, budget=256)
    for _ in range(8):
        sim.step()
    view_steps = [i for i, b in enumerate(sim.batches) if b.num_decode_tokens == 4 and b.num_embed_tokens]
    assert view_steps
    for i in view_steps:  # the only waiting kind: all of the share (a quarter of the step, as priced)
        assert sim.predicted[i] == pytest.approx(sim.batches[i].target_s, rel=0.05)


def test_a_long_prompt_during_decodes_is_chunked_to_the_headroom():
    policy = LatencyAdmission(T, model=LinearStepTime(TRUE))
    sim = ClockSim(policy)
    chats(sim, max_tokens=60)
    sim.step()
    sim.step()
    late = sim.add("late", toks(200, 7000), max_tokens=2)
    while late.num_computed_tokens < late.num_prompt_tokens:
        batch = sim.step()
        assert decode_ids(batch) >= {f"chat{i}" for i in range(4)}
        assert sim.predicted[-1] <= T and batch.planned
        assert batch.num_prefill_tokens == min(32, late.num_prompt_tokens - (late.num_computed_tokens
                                                                             - batch.num_prefill_tokens))
    sim.run()


# ---- priority ----------------------------------------------------------------------------------------------------


def test_a_rerank_more_urgent_than_every_decode_is_not_held_to_the_objective():
    policy = LatencyAdmission(T, model=LinearStepTime(TRUE))
    sim = ClockSim(policy)
    chats(sim, max_tokens=60)
    sim.step()
    sim.step()
    urgent = xenc_flood(sim, "urgent", n=20, priority=-1)
    batch = sim.step()
    assert batch.num_decode_tokens == 4 and pairs_in(batch) == 20  # all of it, far over the target
    assert sim.predicted[-1] > T
    assert all(p.status.finished for p in urgent)
    sim.run()


def test_a_flood_that_aged_past_the_decodes_priority_is_still_held_to_the_objective():
    """Aging (one level per 64 steps waited, the default) lifts a flood's waiting pairs to priority -1 after 64 steps:
    that orders waiting work among itself and must not make the flood "more urgent than every decode" (which is not
    held to the objective: the whole budget at once, far over T, on every step after the 64th)."""
    policy = LatencyAdmission(T, model=LinearStepTime(TRUE))
    sim = ClockSim(policy, aging=64)
    chats(sim, max_tokens=150)
    sim.step()
    pairs = xenc_flood(sim, n=1000)
    for _ in range(140):
        sim.step()
    during = [i for i, b in enumerate(sim.batches) if i > 1 and b.num_decode_tokens == 4]
    assert len(during) >= 130
    assert sim.sched.queues[SeqKind.RERANK].peek_keyed(sim.sched.num_steps)[0][0] < 0  # the flood did age past the chats
    assert all(sim.seconds[i] <= T and pairs_in(sim.batches[i]) == most_pairs(4, 10) for i in during)
    assert not all(p.status.finished for p in pairs)
    sim.run()


def test_a_chat_prompt_gets_its_share_when_the_decodes_leave_no_room_under_the_target():
    """The decodes alone are over T = 5 ms here, so the shares hold as under the automatic target: a late chat's prompt
    is chunked at its share of each step (14 ms / 3 = 4.67 ms: 23 prompt tokens, 24 where a remainder was carried),
    not held until it aged past the decodes' priority."""
    policy = LatencyAdmission(0.005, model=LinearStepTime(TRUE))
    sim = ClockSim(policy, aging=8)
    chats(sim, max_tokens=60)
    sim.step()
    late = sim.add("late", toks(240, 7000), max_tokens=2)
    taken = []
    while late.num_output_tokens == 0:
        batch = sim.step()
        assert batch.num_decode_tokens == 4
        taken.append(sum(n for s, n in zip(batch.seqs, batch.num_new_tokens) if s is late))
    assert all(n in (23, 24) for n in taken[:-1]) and sum(taken) == 240
    sim.run()


def test_a_lower_priority_kind_weighs_half_as_much():
    """Pairs (priority 0) and a waiting chat of priority 1 share the 6.5 ms the decodes leave under T by weight, 2:1:
    the pairs' 4.33 ms buy 2 pairs (2 ms forward + 2 x 1 ms; a third when the ledger saved for it), the chat's
    2.17 ms about 10 prompt tokens; over the run the pairs get 2/3 of what the two took. Once the flood is gone the
    chat takes the whole headroom."""
    policy = LatencyAdmission(T, model=LinearStepTime(TRUE))
    sim = ClockSim(policy)
    chats(sim, max_tokens=100)
    sim.step()
    sim.step()
    pairs = xenc_flood(sim, n=40)
    low = sim.add("low", toks(600, 7000), max_tokens=2, priority=1)
    for _ in range(12):
        batch = sim.step()
        assert pairs_in(batch) in (2, 3) and sim.predicted[-1] <= T
        assert sum(n for s, n in zip(batch.seqs, batch.num_new_tokens) if s is low) >= 5
    steps = range(2, 14)
    pairs_share, chat_share = share_of(sim, "cross_encoder_tokens", steps), share_of(sim, "prefill_tokens", steps)
    assert pairs_share / (pairs_share + chat_share) == pytest.approx(2 / 3, rel=0.1)
    for _ in range(8):
        sim.step()
    assert all(p.status.finished for p in pairs)
    batch = sim.step()  # the flood is gone: the chat takes the headroom
    assert [n for s, n in zip(batch.seqs, batch.num_new_tokens) if s is low] == [32]
    sim.run()


def test_a_lower_priority_flood_still_gets_its_weight_beside_prompts():
    policy = LatencyAdmission(T, model=LinearStepTime(TRUE))
    sim = ClockSim(policy)
    chats(sim, max_tokens=100)
    sim.step()
    sim.step()
    sim.add_rerank_job("llm", [], [toks(30, 5000 + 30 * i) for i in range(20)], priority=1)
    chat = sim.add("chat", toks(200, 7000), max_tokens=2)
    for _ in range(6):
        batch = sim.step()
        assert batch.num_rerank_tokens >= 9 and sim.predicted[-1] <= T  # every step: the flood's weight
    # 6.5 ms split 2:1: the chat about 21 tokens a step (4.33 ms), the flood about 10 (2.17 ms)
    steps = range(2, 8)
    chat_share, flood_share = share_of(sim, "prefill_tokens", steps), share_of(sim, "llm_rerank_tokens", steps)
    assert chat_share / (chat_share + flood_share) == pytest.approx(2 / 3, rel=0.1)
    assert not chat.status.finished
    sim.run()


def test_at_equal_priority_kinds_split_the_headroom_in_arrival_order():
    policy = LatencyAdmission(T, model=LinearStepTime(TRUE))
    sim = ClockSim(policy)
    chats(sim, max_tokens=100)
    sim.step()
    sim.step()
    xenc_flood(sim, n=40, tokens=5)
    chat = sim.add("chat", toks(100, 7000), max_tokens=2)
    batch = sim.step()
    # Half of 6.5 ms to the pairs (first to arrive): the 2 ms forward and 12 tokens, of which 2 pairs fit; the chat
    # then gets the rest as priced, (6.5 - 3.2) / 0.2 = 16 tokens; the pairs nothing more.
    assert pairs_in(batch) == 2
    assert [n for s, n in zip(batch.seqs, batch.num_new_tokens) if s is chat] == [16]
    assert sim.predicted[-1] <= T
    sim.run()


# ---- the fitted model on the fake clock --------------------------------------------------------------------------


def test_the_online_model_converges_to_the_admissions_of_the_true_one():
    policy = LatencyAdmission(T, model=OnlineStepTime())
    sim = ClockSim(policy)
    chats(sim, max_tokens=120)
    xenc_flood(sim, n=1000, tokens=10)
    for _ in range(100):
        sim.step()
    assert not any(b.planned for b in sim.batches[:3])  # cold: plain budget filling until it has seen 8 steps
    steady = flood_steps(sim)[-40:]
    assert len(steady) == 40
    assert all(pairs_in(sim.batches[i]) == 4 for i in steady), [pairs_in(sim.batches[i]) for i in steady]
    assert all(sim.seconds[i] <= T for i in steady)
    coef = policy.model.coefficients()
    assert coef["cross_encoder_tokens"] == pytest.approx(TRUE["cross_encoder_tokens"], rel=0.05)


def test_the_online_model_converges_with_chunked_llm_pairs():
    """LLM-scored pairs of 50 tokens, longer than the 32 tokens of headroom: once fitted, every step beside the decodes
    computes exactly what the true model allows (a chunk of a pair, or the end of one and the start of the next)."""
    policy = LatencyAdmission(T, model=OnlineStepTime())
    sim = ClockSim(policy)
    chats(sim, max_tokens=160)
    pairs = sim.add_rerank_job("llm", [], [toks(50, 9000 + 50 * i) for i in range(200)])
    for _ in range(140):
        sim.step()
    steady = flood_steps(sim)[-50:]
    assert len(steady) == 50
    assert [sim.batches[i].num_rerank_tokens for i in steady] == [32] * 50
    assert all(sim.seconds[i] <= T for i in steady)
    assert sum(p.status is SequenceStatus.FINISHED_STOPPED for p in pairs) >= 60
    assert policy.model.coefficients()["llm_rerank_tokens"] == pytest.approx(TRUE["llm_rerank_tokens"], rel=0.05)


def test_a_more_urgent_pair_overtakes_a_pair_half_way_through():
    """An urgent job (priority -1, more urgent than every decode) arrives while a priority-0 pair is part-way: the
    urgent pair takes the whole step at once, the half-done pair resumes after it with its computed tokens kept."""
    policy = LatencyAdmission(T, model=LinearStepTime(TRUE))
    sim = ClockSim(policy)
    chats(sim, max_tokens=60)
    sim.step()
    (slow,) = sim.add_rerank_job("slow", [], [toks(100, 9000)])
    sim.step()
    sim.step()
    done_before = slow.num_computed_tokens
    assert 0 < done_before < slow.num_tokens
    (urgent,) = sim.add_rerank_job("urgent", [], [toks(80, 12000)], priority=-1)
    batch = sim.step()
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens) if s.kind is SeqKind.RERANK][0] \
        == ("urgent/0", 80)
    assert urgent.status is SequenceStatus.FINISHED_STOPPED
    assert slow.num_computed_tokens >= done_before  # kept, not recomputed
    sim.run()
    assert slow.status is SequenceStatus.FINISHED_STOPPED


def test_a_step_stays_narrow_when_going_wide_costs_more_than_the_headroom():
    """The quantized CPU matmul takes a costlier path above 16 LLM rows (a fixed 10 ms here): with 6.5 ms of headroom
    beside 4 decodes the objective keeps the step at 16 rows (12 rerank tokens) instead of the 32 tokens a linear
    model would admit; with room for the jump it goes wide and takes the rest of the headroom."""
    wide = LinearStepTime({**TRUE, "wide_forward": 0.010}, wide_rows=16)
    assert wide.tokens_within(StepShape(decode_rows=4), "llm_rerank_tokens", T) == 12
    assert wide.tokens_within(StepShape(decode_rows=4), "llm_rerank_tokens", T + 0.010) == 32
    policy = LatencyAdmission(T, model=wide)
    sim = ClockSim(policy)
    sim.true = wide
    chats(sim, max_tokens=60)
    sim.step()
    sim.add_rerank_job("llm", [], [toks(50, 9000 + 50 * i) for i in range(10)])
    rows = []
    for _ in range(20):
        batch = sim.step()
        rows.append(batch.num_decode_tokens + batch.num_rerank_tokens)
        assert sim.seconds[-1] <= T
    # 16 rows a step, less where a pair's last chunk ends the step (the next pair waits for the first's prefix)
    assert max(rows) == 16 and rows.count(16) >= 15
    sim.run()


def test_a_jump_the_model_does_not_price_is_judged_by_the_guard():
    """The model knows the narrow-to-wide threshold but prices the jump at 0 (a fit that has not seen it): steps it
    plans wide run over the target, and the cadence guard shrinks the plan until they stay narrow."""
    blind = LinearStepTime(TRUE, wide_rows=10)
    true = LinearStepTime({**TRUE, "wide_forward": 0.010}, wide_rows=10)
    guard = CadenceGuard(T)
    policy = LatencyAdmission(T, model=blind, cadence=guard)
    sim = ClockSim(policy)
    sim.true = true
    chats(sim, n=4, max_tokens=300)
    sim.step()
    sim.add_rerank_job("llm", [], [toks(40, 9000 + 40 * i) for i in range(60)])
    for _ in range(250):
        sim.step()
    late = [i for i in range(150, 250) if sim.batches[i].num_decode_tokens == 4]
    assert sum(sim.seconds[i] > T for i in late) <= 0.05 * len(late)
    assert sum(sim.batches[i].num_rerank_tokens for i in late) > 0  # pairs still move
    assert guard.scale < 1.0


@pytest.mark.parametrize("bad_steps", [[60], [60, 61, 62], [60, 70, 80, 90]])
def test_steps_that_ran_10x_long_do_not_collapse_the_admissions(bad_steps):
    """A busy machine makes one step (or a burst of three, or one every ten) take 10x its time: the robust fit
    ignores them, so at most a few steps admit less than the converged 4 pairs."""
    policy = LatencyAdmission(T, model=OnlineStepTime())
    sim = ClockSim(policy, slow={s: 10.0 for s in bad_steps})
    chats(sim, max_tokens=150)
    xenc_flood(sim, n=1000, tokens=10)
    for _ in range(120):
        sim.step()
    after = [pairs_in(sim.batches[i]) for i in flood_steps(sim) if i >= 50]
    assert sum(n < 4 for n in after) <= 3, after
    assert min(after) >= 1


def test_a_lasting_slowdown_is_followed():
    """When every step runs 3x long from some point on (the machine is that much slower now), the fit follows and
    the admissions shrink to what the slower machine allows: the decodes alone then take 42 ms, over the target, so
    the shares hold as under the automatic target: the pairs take about a quarter of each step."""
    policy = LatencyAdmission(T, model=OnlineStepTime(window=64))
    sim = ClockSim(policy, slow={s: 3.0 for s in range(60, 400)})
    chats(sim, max_tokens=200)
    xenc_flood(sim, n=2000, tokens=10)
    for _ in range(160):
        sim.step()
    assert max(pairs_in(sim.batches[i]) for i in range(20, 60)) == 4  # before: the headroom's 4 pairs a step
    late = range(130, 160)
    assert all(1 <= pairs_in(sim.batches[i]) <= 4 for i in late)
    assert share_of(sim, "cross_encoder_tokens", late) == pytest.approx(0.25, rel=0.15)


def test_a_cold_model_plans_as_plain_budget_filling_until_it_is_ready():
    """No prices yet (an engine nobody calibrated, in its first steps): the fallback's plain budget filling, not
    admissions sized by a slow prior; a seeded (calibrated) model plans at once."""
    cold = ClockSim(LatencyAdmission(T, model=OnlineStepTime(min_samples=10**6)))
    share = ClockSim(LatencyAdmission(T, model=OnlineStepTime(min_samples=10**6)))
    share.policy = share.sched.policy = ShareAdmission()
    for sim in (cold, share):
        chats(sim, max_tokens=30)
        xenc_flood(sim, n=50)
        for _ in range(10):
            sim.step()
    assert [[s.request_id for s in b.seqs] for b in cold.batches] == \
        [[s.request_id for s in b.seqs] for b in share.batches]
    assert not any(b.planned for b in cold.batches)
    seeded = OnlineStepTime()
    seeded.seed(TRUE, 0.0)
    warm = ClockSim(LatencyAdmission(T, model=seeded))
    chats(warm, max_tokens=30)
    xenc_flood(warm, n=50)
    for _ in range(5):
        warm.step()
    assert [pairs_in(b) for b in warm.batches[1:5]] == [4] * 4 and all(b.planned for b in warm.batches[1:5])


# ---- the cadence guard: what the host adds to the model's plan ----------------------------------------------------


def test_a_host_slower_than_the_plan_is_brought_back_under_the_target_by_the_cadence_guard():
    """Every step runs 1.15x what the (fixed) model predicts: without the guard every step planned up to the target
    runs over it; with it, the planned limit shrinks until at most a few planned steps in a hundred do, and pairs
    still ride in every step: one pair (17 ms planned, 19.6 ms on this host; two would take 20.7 ms, over the
    20.5 ms target), two only in the rare step where the guard probes upwards."""
    slow = {s: 1.15 for s in range(400)}
    runs = {}
    for guarded in (False, True):
        policy = LatencyAdmission(T, model=LinearStepTime(TRUE), cadence=CadenceGuard(T) if guarded else None)
        sim = ClockSim(policy, slow=slow)
        chats(sim, max_tokens=300)
        xenc_flood(sim, n=3000, tokens=10)
        for _ in range(300):
            sim.step()
        late = [i for i in flood_steps(sim) if i >= 100]
        runs[guarded] = (sum(sim.seconds[i] > T for i in late) / len(late), [pairs_in(sim.batches[i]) for i in late])
        sim.run()
    over, pairs = runs[False]
    assert over == 1.0 and min(pairs) == 4
    over, pairs = runs[True]
    assert over <= 0.03, over
    assert min(pairs) == 1 and max(pairs) <= 2 and pairs.count(1) >= 0.95 * len(pairs)


def test_progress_only_steps_over_the_target_do_not_shrink_the_plan():
    """The decodes alone are over the target on this host (4 decodes x 1.6 = 22.4 ms): once the prompts are in,
    only minimum progress rides beside them, no plan made those steps long, so the guard neither counts them nor
    moves."""
    guard = CadenceGuard(T)
    policy = LatencyAdmission(T, model=LinearStepTime(TRUE), cadence=guard)
    sim = ClockSim(policy, slow={s: 1.6 for s in range(200)})
    chats(sim, max_tokens=100)
    xenc_flood(sim, n=200, tokens=10)
    for _ in range(10):
        sim.step()
    assert all(b.num_decode_tokens == 4 and not b.num_prefill_tokens for b in sim.batches[-3:])
    planned, scale = guard.planned, guard.scale
    for _ in range(50):
        sim.step()
    assert sum(pairs_in(b) for b in sim.batches[10:]) >= 5
    assert guard.planned == planned and guard.scale == scale
    sim.run()


def test_the_guard_counts_the_time_between_steps_and_steps_without_decodes_reset_it():
    guard = CadenceGuard(0.010, cut=0.1)
    guard.observe(0.000, 0.009, decodes=True, planned=True)  # 9 ms: within
    guard.observe(0.0095, 0.008, decodes=True, planned=True)  # ends 8.5 ms after the last: within
    assert guard.over == 0 and guard.planned == 2 and guard.scale == 1.0
    guard.observe(0.0195, 0.009, decodes=True, planned=True)  # 9 ms long, but 11 ms since the last token: over
    assert guard.over == 1 and guard.scale == pytest.approx(0.9)
    guard.observe(0.100, 0.009, decodes=False, planned=True)  # no decodes: nothing to time, and the chain breaks
    guard.observe(0.200, 0.009, decodes=True, planned=True)  # its own 9 ms only
    assert guard.over == 1 and guard.planned == 4
    guard.observe(0.2095, 0.020, decodes=True, planned=False)  # over, but floors only: not counted
    assert guard.over == 1 and guard.planned == 4 and guard.scale > 0.9


def test_the_guard_settles_where_its_share_of_intervals_is_over_the_target():
    """Planned steps whose time is proportional to the plan, with a lognormal host noise: the scale settles where
    about 1% of the intervals are over the target (a quantile tracked online), above its floor."""
    import random

    rng = random.Random(7)
    guard = CadenceGuard(0.020)
    clock, over_late = 0.0, []
    for i in range(40000):
        seconds = 0.018 * guard.scale * rng.lognormvariate(0.0, 0.1)
        if i >= 10000:
            over_late.append(guard.interval(clock, seconds) > 0.020)  # the interval the guard is about to see
        guard.observe(clock, seconds, decodes=True, planned=True)
        clock += seconds
    share = sum(over_late) / len(over_late)
    assert 0.005 <= share <= 0.02, share
    assert guard.min_scale < guard.scale < 1.0


@pytest.mark.parametrize("kw", [dict(target_s=0), dict(target_s=0.01, exceed=1.0), dict(target_s=0.01, cut=0),
                                dict(target_s=0.01, min_scale=0)])
def test_a_bad_guard_is_refused(kw):
    with pytest.raises(ValueError):
        CadenceGuard(**kw)


# ---- config --------------------------------------------------------------------------------------------------------


def test_tpot_target_ms_selects_the_objective():
    policy = policy_for(EngineConfig(num_kv_blocks=16, block_size=4, tpot_target_ms=40, scoring_share=0.3))
    assert isinstance(policy, LatencyAdmission)
    assert policy.tpot_target_s == pytest.approx(0.040) and policy.scoring_share == 0.3
    assert isinstance(policy.model, OnlineStepTime)
    assert isinstance(policy.cadence, CadenceGuard)
    auto = policy_for(EngineConfig(num_kv_blocks=16, block_size=4))  # on by default, the automatic target
    assert isinstance(auto, LatencyAdmission) and auto.tpot_target_s is None
    assert isinstance(policy_for(EngineConfig(num_kv_blocks=16, block_size=4, tpot_target_ms=None)), ShareAdmission)


def test_the_automatic_target_follows_the_running_decodes():
    policy = LatencyAdmission(model=LinearStepTime(TRUE))
    assert policy.target_for(StepShape(decode_rows=4)) == pytest.approx((1 / 0.75) * 0.014)
    assert policy.target_for(StepShape(decode_rows=8)) == pytest.approx((1 / 0.75) * 0.018)
    tiny = LatencyAdmission(model=LinearStepTime({k: 0.0 for k in TRUE}))
    assert tiny.target_for(StepShape(decode_rows=1)) == tiny.min_target_s  # floored


def test_the_automatic_target_prices_a_burst_of_chats_at_the_step_they_will_share():
    """Seven chats arrive while one decodes: T is priced at the step of all eight decodes (18 ms / 0.75), not at the
    lone chat's 11 ms (which left ~3 ms a step, a few prompt tokens, and fed the burst to it over dozens of steps)."""
    policy = LatencyAdmission(model=LinearStepTime(TRUE))
    assert policy.target_for(StepShape(decode_rows=1, decode_context_tokens=10), joining=7) \
        == pytest.approx((1 / 0.75) * 0.018)
    sim = ClockSim(policy)
    sim.add("first", toks(3, 10), max_tokens=100)
    sim.step()  # alone: its whole prompt
    burst = [sim.add(f"chat{i}", toks(40, 100 + 40 * i), max_tokens=50) for i in range(7)]
    steps = 0
    while any(s.num_output_tokens == 0 for s in burst):
        batch = sim.step()
        steps += 1
        assert batch.num_decode_tokens >= 1 and batch.target_s == pytest.approx((1 / 0.75) * 0.018)
        assert sim.seconds[-1] <= batch.target_s
    assert steps <= 8, steps
    sim.run()


def test_a_burst_prices_the_automatic_target_no_wider_than_the_narrow_path():
    """32 chats waiting beside 2 decodes on a model whose steps go wide past 8 rows: T is that of 8 decodes, not of
    34 (whose wide step would also widen the room every scoring kind gets beside the decodes); past 8 running decodes,
    the running ones alone."""
    policy = LatencyAdmission(model=LinearStepTime(TRUE, wide_rows=8))
    eight = policy.model.predict(StepShape(decode_rows=8, decode_context_tokens=40))
    assert policy.target_for(StepShape(decode_rows=2, decode_context_tokens=10), joining=32) \
        == pytest.approx((1 / 0.75) * eight)
    twelve = policy.model.predict(StepShape(decode_rows=12, decode_context_tokens=120))
    assert policy.target_for(StepShape(decode_rows=12, decode_context_tokens=120), joining=20) \
        == pytest.approx((1 / 0.75) * twelve)


@pytest.mark.parametrize("value", [0, -5, float("nan"), float("inf"), "40"])
def test_a_bad_tpot_target_is_a_config_error(value):
    with pytest.raises(ValueError, match="tpot_target_ms"):
        EngineConfig(tpot_target_ms=value)


def test_an_explicit_policy_wins_over_the_config():
    given = ShareAdmission()
    assert policy_for(EngineConfig(tpot_target_ms=40), given) is given


# ---- the planner is a pure function of what it is shown ------------------------------------------------------------


def _views():
    from hypothesis import strategies as st

    from engine.admission import StepView, Waiting
    from engine.step_time import TokenKind

    waiting = st.builds(Waiting, kind=st.sampled_from(list(TokenKind)), priority=st.integers(-1, 2),
                        urgency=st.integers(-1, 2),
                        arrival=st.integers(0, 50), unit=st.integers(1, 40), least=st.integers(1, 40),
                        tokens=st.integers(1, 400))
    return st.builds(StepView, shape=st.builds(StepShape, decode_rows=st.integers(0, 16),
                                               decode_context_tokens=st.integers(0, 4000)),
                     decode_priority=st.one_of(st.none(), st.integers(0, 1)), budget=st.integers(0, 512),
                     free_seats=st.integers(0, 32),
                     waiting=st.lists(waiting, max_size=4, unique_by=lambda w: w.kind).map(tuple),
                     wide_budget=st.integers(0, 4096), joining=st.integers(0, 8))


def test_the_planner_is_pure_and_holds_no_reference_to_the_scheduler():
    """Same view, same quota (the view is all it reads, and planning leaves the policy as it found it); its fields
    hold a step-time model, a fallback and a guard, never the scheduler or its queues."""
    import dataclasses

    from hypothesis import given, settings

    from engine.scheduler import Scheduler, WaitQueue

    policy = LatencyAdmission(model=LinearStepTime(TRUE), cadence=CadenceGuard())
    for f in dataclasses.fields(policy):
        assert not isinstance(getattr(policy, f.name), (Scheduler, WaitQueue))
    share = ShareAdmission()

    @settings(max_examples=300, deadline=None)
    @given(_views())
    def check(view):
        for p in (policy, share):
            before = repr(p)
            first = p.plan(view)
            assert p.plan(view) == first and repr(p) == before
        if view.decode_priority is not None:  # the objective's own plan: only kinds that wait
            kinds = {w.kind for w in view.waiting}
            assert all(g.kind in kinds for g in policy.plan(view).grants)

    check()


def test_every_kind_progresses_beside_decodes_within_the_target():
    """Chats decode while a prompt, LLM-scored pairs, cross-encoder pairs and embedding rows all wait, at one
    priority, under a model whose prices are right: every kind rides in steps with the decodes, every planned step's
    time is within T, and all of it finishes."""
    prices = {**TRUE, "embed_forward": 0.001, "embed_tokens": 0.0001}
    policy = LatencyAdmission(T, model=LinearStepTime(prices))
    sim = ClockSim(policy)
    sim.true = LinearStepTime(prices)
    chats(sim, max_tokens=120)
    sim.step()
    sim.step()
    llm = sim.add_rerank_job("llm", toks(4, 800), [toks(12, 5000 + 12 * i) for i in range(6)])
    xenc = xenc_flood(sim, "xenc", n=12, tokens=8)
    rows = [sim.add_embed(f"emb/{i}", toks(10, 9000 + 10 * i), stages=2) for i in range(8)]
    late = sim.add("late", toks(60, 7000), max_tokens=2)
    seen = {"llm": False, "xenc": False, "emb": False, "late": False}
    for _ in range(100):
        batch = sim.step()
        if batch.num_decode_tokens == 4:
            assert sim.seconds[-1] <= T + 1e-12
            for s in batch.seqs:
                for name in seen:
                    seen[name] = seen[name] or s.request_id.startswith(name)
    assert all(seen.values()), seen
    assert all(s.status.finished for s in llm + xenc + rows)
    assert late.num_output_tokens > 0
    sim.run()


def test_the_online_fit_reports_its_error_per_kind_and_prices_embedding_rows_as_the_mixed_steps_measure():
    """The online model starts from a calibration that priced the embedder's forward 10x (15 ms where mixed steps
    measure 1.5 ms: issue #62's mispricing); fitted on the mixed steps that carry embedding rows, it prices them as
    measured, and reports the error of its fit per kind of work (small once it has followed)."""
    prices = {**TRUE, "embed_forward": 0.0015, "embed_tokens": 0.0001}
    model = OnlineStepTime()
    model.seed({**prices, "embed_forward": 0.015}, 0.0)
    policy = LatencyAdmission(model=model)
    sim, _ = embed_flood_beside_chats(policy, prices, 400, max_tokens=300)
    for _ in range(150):
        sim.step()
    errors = model.fit_errors()
    assert errors["embed_tokens"][0] >= 50 and errors["embed_tokens"][1] < 0.02
    assert errors["decodes"][1] < 0.02 or errors["decodes"][0] == 0
    assert model.coefficients()["embed_forward"] == pytest.approx(0.0015, rel=0.2)
