"""The latency objective's deadlines (issue #70) in the scheduler simulator, on its fake clock: every request is due its
first result `stretch` times its price alone after it arrives, a chat's later tokens a pace apart; work still on time
is served earliest deadline first and may take what the decodes' slack lends, late work keeps its share.

Steps take what a known linear step-time model (PRICES) says, the policy plans with the same model, so the times
below are exact functions of the rule, not of this machine.
"""
from __future__ import annotations

import math

import pytest

from engine.admission import LatencyAdmission
from engine.request import Sequence
from engine.step_time import LinearStepTime, StepShape
from tests.engine.test_admission import TRUE, ClockSim
from tests.engine.test_scheduler import toks

PRICES = {**TRUE, "embed_forward": 0.001, "embed_tokens": 0.0001}


def policy(**kw) -> LatencyAdmission:
    return LatencyAdmission(model=LinearStepTime(PRICES), **kw)


class DeadlineSim(ClockSim):
    """ClockSim whose requests get their deadlines from the policy, as LLMEngine._queue gives them, and which notes
    when each row finished and when each chat's tokens came (the fake clock at the end of their step)."""

    def __init__(self, admission: LatencyAdmission, **kw) -> None:
        super().__init__(admission, **{"budget": 512, "max_seqs": 64, "num_blocks": 4096} | kw)
        self.true = LinearStepTime(PRICES)
        self.done_at: dict[str, float] = {}
        self.token_times: dict[str, list[float]] = {}

    def due(self, rows: list[list[int]], kind: str) -> float:
        return self.policy.deadline(StepShape(**{kind: sum(map(len, rows))}), self.clock)

    def chat(self, rid: str, prompt: list[int], max_tokens: int) -> Sequence:
        return self.add(rid, prompt, max_tokens=max_tokens, deadline=self.due([prompt], "prefill_tokens"))

    def rerank(self, rid: str, docs: list[list[int]], deadline: float | None = None) -> list[Sequence]:
        deadline = self.due(docs, "cross_encoder_tokens") if deadline is None else deadline
        return self.add_rerank_job(rid, [], docs, uses_kv=False, deadline=deadline)

    def embed(self, rid: str, texts: list[list[int]], deadline: float | None = None) -> list[Sequence]:
        deadline = self.due(texts, "embed_tokens") if deadline is None else deadline
        return [self.add_embed(f"{rid}/{i}", t, deadline=deadline) for i, t in enumerate(texts)]

    def step(self):
        batch = super().step()
        for seq in self.seqs.values():
            if seq.status.finished and seq.request_id not in self.done_at:
                self.done_at[seq.request_id] = self.clock
            if seq.samples and seq.num_output_tokens > len(self.token_times.get(seq.request_id, [])):
                self.token_times.setdefault(seq.request_id, []).append(self.clock)
        return batch

    def run_until(self, rows: list[Sequence], limit: int = 2000) -> None:
        for _ in range(limit):
            if all(r.status.finished for r in rows):
                return
            self.step()
        raise AssertionError(f"not done in {limit} steps")


def docs(n: int, tokens: int, base: int) -> list[list[int]]:
    return [toks(tokens, base + tokens * i) for i in range(n)]


def chats(sim: DeadlineSim, n: int, max_tokens: int = 400) -> list[Sequence]:
    return [sim.chat(f"chat{i}", toks(3, 10 * i), max_tokens) for i in range(n)]


def decoding(sim: DeadlineSim, rows: list[Sequence]) -> None:
    while not all(r.num_output_tokens for r in rows):
        sim.step()


def test_a_stream_ahead_of_its_pace_lends_its_slack_and_no_token_misses_its_deadline():
    """4 chats whose first tokens came far ahead of their deadlines, then a cross-encoder flood that is on time: the
    steps run past the automatic target on the chats' slack (the flood gets more than the target leaves), never past
    one pace (1.5x the decodes' own step), and every chat token still comes by its deadline (its first's plus a pace a
    token)."""
    sim = DeadlineSim(policy())
    rows = chats(sim, 4)
    decoding(sim, rows)
    flood = sim.rerank("flood", docs(1000, 10, 5000), deadline=sim.clock + 10.0)
    for _ in range(60):
        sim.step()
    target, pace = sim.policy.target_for(StepShape(decode_rows=4)), sim.policy.pace(StepShape(decode_rows=4))
    mixed = [s for b, s in zip(sim.batches, sim.seconds) if b.num_decode_tokens == 4 and b.num_rerank_pairs]
    assert len(mixed) >= 50
    assert max(mixed) > target * 1.05  # the slack was lent: a step longer than the target
    assert max(mixed) <= pace * (1 + 1e-9)  # never longer than a pace
    for r in rows:
        first = r.deadline
        for k, at in enumerate(sim.token_times[r.request_id]):
            assert at <= first + k * pace + 1e-9, (r.request_id, k)
    assert not all(p.status.finished for p in flood)  # a flood: still going, lending, not taking the chats' turn


def flood_step_times(late_chats: bool | None) -> list[float]:
    """The step times of 4 chats beside an on-time cross-encoder flood; the chats' first tokens due as their price
    says, 10 s ago (`late_chats`), or never (None: no deadlines, the steps the shares alone make)."""
    sim = DeadlineSim(policy())
    rows = [sim.add(f"chat{i}", toks(3, 10 * i), max_tokens=400,
                    deadline=None if late_chats is None else sim.clock - 10.0 if late_chats
                    else sim.due([toks(3, 0)], "prefill_tokens")) for i in range(4)]
    decoding(sim, rows)
    sim.rerank("flood", docs(1000, 10, 5000), deadline=sim.clock + 10.0)
    for _ in range(40):
        sim.step()
    return sim.seconds


def test_a_stream_behind_its_pace_lends_nothing():
    """The same chats, their first tokens due 10 s ago (late, so every later token too): the steps are those
    of the shares alone, as if the chats had no deadlines; ahead of their pace, they lend (longer steps)."""
    assert flood_step_times(late_chats=True) == flood_step_times(late_chats=None)
    assert sum(flood_step_times(late_chats=False)) > sum(flood_step_times(late_chats=None))


def rerank_beside_8_decodes_and_a_flood(with_deadline: bool) -> tuple[float, float]:
    """8 chats decoding and an embedding flood of ingest rows (no deadline: it was sent in bulk), then a rerank of
    40 pairs of 10 tokens; returns when the rerank finished and when it was due."""
    sim = DeadlineSim(policy())
    rows = chats(sim, 8)
    decoding(sim, rows)
    sim.embed("ingest", docs(2000, 10, 90000), deadline=math.inf)
    for _ in range(3):
        sim.step()
    pairs = docs(40, 10, 5000)
    due = sim.due(pairs, "cross_encoder_tokens")
    job = sim.rerank("rag", pairs, deadline=due if with_deadline else math.inf)
    start = len(sim.batches)
    sim.run_until(job)
    assert all(b.num_decode_tokens == 8 for b in sim.batches[start:])  # the chats rode every step
    return max(sim.done_at[p.request_id] for p in job), due


def test_a_rerank_is_served_by_its_deadline_beside_8_decodes():
    """A rerank due 4x its price alone, beside 8 decoding chats and an ingest flood, is done by its deadline: it goes
    before the flood, on the time the target leaves beside the decodes and what their slack lends. Without its
    deadline it would split that time with the flood, and miss it."""
    done, due = rerank_beside_8_decodes_and_a_flood(with_deadline=True)
    assert done <= due
    done_without, _ = rerank_beside_8_decodes_and_a_flood(with_deadline=False)
    assert done_without > due  # what the deadline changed


def test_one_text_is_not_queued_behind_a_flood_of_embedding_batches():
    """30 embedding batches of 16 texts arrive together beside 4 chats; a few steps later one question's text: it is
    embedded by its own deadline, before the batches that were still waiting when it came (their deadlines, 4x
    their price alone from their arrival, are later)."""
    sim = DeadlineSim(policy())
    rows = chats(sim, 4)
    decoding(sim, rows)
    batches = [sim.embed(f"batch{b}", docs(16, 20, 20000 + 400 * b)) for b in range(30)]
    for _ in range(3):
        sim.step()
    waiting = [r for batch in batches for r in batch if not r.status.finished]
    assert waiting
    question = sim.embed("question", [toks(12, 77)])
    sim.run_until(question)
    done = sim.done_at["question/0"]
    assert done <= question[0].deadline
    assert sum(r.status.finished for r in waiting) < len(waiting) // 4  # most of the flood was still waiting


def test_work_that_cannot_meet_its_deadline_is_served_late_never_starved():
    """A rerank already past its deadline when it arrives, beside 4 chats and an on-time embedding flood that could
    fill every step: the flood goes first (it can still make it), and the late rerank is still served by its share
    of the steps, done long before the flood is."""
    sim = DeadlineSim(policy())
    rows = chats(sim, 4)
    decoding(sim, rows)
    flood = sim.embed("flood", docs(3000, 10, 90000), deadline=sim.clock + 100.0)
    late = sim.rerank("late", docs(30, 10, 5000), deadline=sim.clock)
    start = len(sim.batches)
    sim.run_until(late)
    assert sim.done_at[late[0].request_id] > late[0].deadline  # served late
    assert sum(r.status.finished for r in flood) < len(flood) // 2  # not after the flood: its share kept it moving
    after = sim.batches[start:]
    assert sum(b.num_embed_rows > 0 for b in after) > len(after) // 2  # the on-time flood kept going beside it


@pytest.mark.parametrize("kw", [dict(stretch=0.5), dict(max_lend=0.9), dict(overhead_share=1.0)])
def test_a_bad_stretch_or_lend_is_refused(kw):
    with pytest.raises(ValueError):
        policy(**kw)


def test_a_deadline_is_the_stretch_times_the_price_alone_and_none_before_the_model_is_ready():
    p = policy(stretch=3.0)
    shape = StepShape(cross_encoder_tokens=100)
    assert p.deadline(shape, 10.0) == pytest.approx(10.0 + 3.0 * LinearStepTime(PRICES).predict(shape))
    sim = DeadlineSim(p)
    chats(sim, 2)
    sim.step()
    sim.step()  # a step with decodes: it had a target, a request may wait one such step on top
    assert p.step_s == sim.batches[-1].target_s > 0
    assert p.deadline(shape, 10.0) == pytest.approx(10.0 + 3.0 * LinearStepTime(PRICES).predict(shape) + p.step_s)
    assert LatencyAdmission().deadline(shape, 10.0) is None  # an online model with no steps yet


def test_the_engine_gives_every_row_of_a_request_its_deadline_from_its_price_alone():
    """LLMEngine queues each request with the policy's deadline: all rows of one request share it, and it is the
    stretch times the price of the request's work alone (an embedding's rows, a chat's prompt) after its arrival."""
    from engine import SamplingParams
    from engine.config import EMBEDDED_EMBEDDER
    from engine.request import SeqKind
    from tests.engine.conftest import assert_no_leaks, make_llm, run_to_end

    model = LinearStepTime(PRICES)
    llm = make_llm(admission=LatencyAdmission(model=model), embedder=EMBEDDED_EMBEDDER)
    engine = llm.engine
    engine.add_embed("emb", ["bees make honey", "stocks fell on Monday", "honey bees live in colonies"])
    engine.add_request("chat", "The capital of France is", SamplingParams(max_tokens=2))
    queued = [*engine.scheduler.queues[SeqKind.EMBED], *engine.scheduler.queues[SeqKind.GENERATE]]
    rows = [s for s in queued if s.kind is SeqKind.EMBED]
    chat = next(s for s in queued if s.kind is SeqKind.GENERATE)
    assert len(rows) == 3 and len({r.deadline for r in rows}) == 1
    assert rows[0].deadline == pytest.approx(rows[0].arrival_time + 4.0 * model.predict(StepShape.of_rows(rows)))
    assert chat.deadline == pytest.approx(chat.arrival_time + 4.0 * model.predict(
        StepShape(prefill_tokens=chat.num_prompt_tokens)))
    run_to_end(engine)
    assert_no_leaks(llm)


def test_the_config_sets_the_stretch_and_none_turns_deadlines_off():
    from engine.admission import policy_for
    from engine.config import EngineConfig

    assert policy_for(EngineConfig(deadline_stretch=6.0)).stretch == 6.0
    off = policy_for(EngineConfig(deadline_stretch=None))
    off.model = LinearStepTime(PRICES)  # ready: still no deadline
    assert off.deadline(StepShape(prefill_tokens=10), 1.0) is None
    with pytest.raises(ValueError):
        EngineConfig(deadline_stretch=0.5)


SLOW_PREFILL = {**PRICES, "prefill_tokens": 0.002}  # 2 ms a prompt token, as a small LLM on two CPU cores


@pytest.mark.parametrize("deadlines", [True, False])
@pytest.mark.parametrize("ahead", ["prompt", "ingest"])
def test_with_no_decodes_a_step_is_held_to_a_quantum_so_a_question_waits_one_quantum(ahead, deadlines):
    """No chat decodes yet: a 2,000-token prompt prefills (a 512-token chunk would be a 1 s step), or an ingest of
    16,384 embedding tokens runs (wide steps of 4,096). A question's text that arrives after the first step is embedded
    within one quantum (the largest fixed forward cost over `overhead_share`: 10 ms / 0.05 = 0.2 s) plus its own
    price; without deadlines (stretch None) it waits out the whole chunk or wide step."""
    sim = DeadlineSim(LatencyAdmission(model=LinearStepTime(SLOW_PREFILL), stretch=4.0 if deadlines else None,
                                       overhead_share=0.05),
                      max_seqs=256)
    sim.true = LinearStepTime(SLOW_PREFILL)  # steps take what the policy's model says (the wide budget: 4,096)
    if ahead == "prompt":
        sim.chat("answer", toks(2000, 50000), max_tokens=4)
    else:
        sim.embed("ingest", docs(1024, 16, 70000), deadline=sim.clock + 100.0)
    first = sim.step()
    assert first.seqs
    arrived = sim.clock
    question = sim.embed("question", [toks(12, 77)])
    quantum = 0.010 / 0.05
    own = LinearStepTime(SLOW_PREFILL).predict(StepShape(embed_tokens=12))
    sim.run_until(question)
    waited = sim.done_at["question/0"] - arrived
    if deadlines:
        assert waited <= quantum + own + 1e-9
        assert all(p <= quantum + 1e-9 for p in sim.predicted[1:])  # every step after the first held to it
    else:
        assert waited > 4 * quantum  # behind a whole 512-token chunk (1 s) or the wide steps (0.41 s each)


def test_the_quantum_counts_the_wide_paths_jump_so_a_prompt_alone_keeps_its_whole_chunk():
    """On a CPU a prompt's chunk past the narrow path's rows pays the wide path's jump (here 80 ms) once a step:
    chopping it into quantum-sized pieces would pay it again each time. The quantum is the fixed part of a step at the
    size the kind would run, so a 2,000-token prompt alone still prefills in whole 512-token chunks."""
    wide = {**SLOW_PREFILL, "wide_forward": 0.080}
    sim = DeadlineSim(LatencyAdmission(model=LinearStepTime(wide, wide_rows=16), overhead_share=0.05), max_seqs=256)
    sim.true = LinearStepTime(wide, wide_rows=16)
    answer = sim.chat("answer", toks(2000, 50000), max_tokens=2)
    for _ in range(3):
        sim.step()
    assert [b.num_prefill_tokens for b in sim.batches[:3]] == [512, 512, 512]
    assert all(p > 1.0 for p in sim.predicted[:3])  # 10 + 80 ms + 512 x 2 ms each: within (10 + 80) / 0.05 = 1.8 s
    sim.run_until([answer])


def prompt_steps(sim: DeadlineSim, answers: list[Sequence], rag_every: int | None = None) -> list:
    """Steps until every one of `answers` has its first token; `rag_every`: another user's rerank of 8 pairs (each
    due 4x its price alone, so before a prompt) arrives before every such step. Returns those steps' batches."""
    start = len(sim.batches)
    for k in range(2000):
        if all(sim.token_times.get(a.request_id) for a in answers):
            return sim.batches[start:]
        if rag_every is not None and k % rag_every == 0:
            sim.rerank(f"rag{k}", docs(8, 10, 100000 + 100 * k))
        sim.step()
    raise AssertionError("no first token in 2000 steps")


def paced_sim() -> tuple[DeadlineSim, float]:
    """8 chats decoding, prompt tokens at 2 ms each (a small LLM on two CPU cores), priorities aging one level per 64
    steps as in the engine (EngineConfig.priority_aging_steps); returns the sim and the chats' pace."""
    sim = DeadlineSim(LatencyAdmission(model=LinearStepTime(SLOW_PREFILL)), aging=64)
    sim.true = LinearStepTime(SLOW_PREFILL)
    decoding(sim, chats(sim, 8, max_tokens=1000))
    return sim, sim.policy.pace(StepShape(decode_rows=8))


def test_a_prompt_beside_8_decodes_is_paced_to_its_deadline_not_lifted_into_one_chunk():
    """A RAG answer's 512-token prompt (~1 s alone, due ~4 s later) beside 8 decoding chats, while other users'
    reranks keep coming (one a step, each due before the prompt). Each step it gets what it needs to be done by its
    deadline at the steps' cadence: never more than a few of its tokens in a step, no stream waits more than two paces
    for a token, and its first token comes by its deadline; the reranks are still served. Before (issue #70) the
    reranks, due sooner, took the step ahead of it until aging made it more urgent than the decodes (63 steps); then
    it took 504 tokens in one ~1 s step, and its first token was late all the same."""
    sim, pace = paced_sim()
    answer = sim.chat("answer", toks(512, 50000), max_tokens=4)
    steps = prompt_steps(sim, [answer], rag_every=1)
    assert all(b.num_decode_tokens == 8 for b in steps)  # every stream's gap is a step
    assert max(b.num_prefill_tokens for b in steps) <= 16
    assert max(sim.seconds[-len(steps):]) <= 2 * pace
    assert sim.token_times["answer"][0] <= answer.deadline
    reranks = [s for s in sim.seqs.values() if s.request_id.startswith("rag")]
    assert sum(not s.status.finished for s in reranks) <= 16  # at most the last two reranks' pairs still wait


def test_a_prompt_waiting_for_another_is_not_lifted_by_aging_while_it_is_on_time():
    """Two 1,024-token prompts (~2 s each alone, due ~8 s later) sent together beside 8 decoding chats: the second
    waits in the queue while the first takes the prompts' tokens, for longer than the 64 steps aging takes to make it
    more urgent than the decodes. While it is on time its deadline paces it, not aging: both prompts are spread over
    the steps (no stream waits more than two paces), and both first tokens come by their deadlines. Lifted by aging
    (before issue #70's fix) the waiting one took a whole 504-token chunk in one ~1 s step, 63 steps in."""
    sim, pace = paced_sim()
    answers = [sim.chat(f"answer{i}", toks(1024, 50000 + 2000 * i), max_tokens=4) for i in range(2)]
    steps = prompt_steps(sim, answers)
    assert len(steps) > 64
    assert all(b.num_decode_tokens >= 8 for b in steps)  # the 8 streams (and the first answer's tokens) every step
    assert max(b.num_prefill_tokens for b in steps) <= 16
    assert max(sim.seconds[-len(steps):]) <= 2 * pace
    for a in answers:
        assert sim.token_times[a.request_id][0] <= a.deadline, a.request_id
