"""Scheduler driven with fake sequences and a real KVCacheManager (no model).

A `Sim` plays the engine's part: it calls `schedule()`, "computes" the batch by writing each token into a
shadow KV store at the slot its block table names, samples a fake token (a function of request id and
output index) for every generation whose prefill completed, calls `update()`, and finishes sequences
that reached max_tokens (rerank pairs finish when scored). After every step it checks the invariants:
budget and max_num_seqs, every running decode scheduled (or preempted), ref counts equal the block
tables that hold each block, the free list holds exactly the unreferenced blocks, waiting sequences hold
nothing, and every computed position of every running sequence reads back its own token from the
shadow KV store (so prefix-cache hits, eviction and preemption never hand out wrong or shared-and-
overwritten blocks).
"""
from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.admission import AdmissionPolicy, Grant, Quota, StepView, policy_for
from engine.config import EmbedParams, EngineConfig, RerankParams, SamplingParams
from engine.kv_cache import BlockPool, KVCacheManager
from engine.request import RerankPair, RowExec, Sequence, SequenceStatus, SeqKind
from engine.scheduler import Batch, Scheduler
from engine.step_time import TokenKind


def fake_token(rid: str, index: int) -> int:
    return 1000 + (sum(map(ord, rid)) * 31 + index * 7) % 997


class Sim:
    def __init__(self, *, num_blocks=64, block_size=4, budget=32, max_seqs=16, aging=10**6,
                 prefix_caching=True, scheduling="continuous", scoring_share=0.5, admission=None):
        self.cfg = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, max_num_batched_tokens=budget,
                                max_num_seqs=max_seqs, priority_aging_steps=aging,
                                enable_prefix_caching=prefix_caching, scheduling=scheduling,
                                scoring_share=scoring_share, tpot_target_ms=None)
        self.bs = block_size
        self.pool = BlockPool(num_blocks)
        self.kv = KVCacheManager(self.pool, block_size, prefix_caching)
        self.sched = Scheduler(self.cfg, self.kv, admission if admission is not None else policy_for(self.cfg))
        self._arrivals = itertools.count()
        self.seqs: dict[str, Sequence] = {}
        self.shadow: dict[tuple[int, int], int] = {}  # (block, slot) -> token whose KV sits there
        self.hash_content: dict[int, tuple[int, ...]] = {}  # block hash -> the block's tokens
        self.batches: list[Batch] = []
        self.admitted_order: list[str] = []  # first admissions
        self.admissions: list[str] = []  # every admission, re-admissions after preemption included
        self.finished_order: list[str] = []
        self.preempted: list[str] = []
        self.steps = 0
        self.clock = 0.0  # the deadlines' clock: arrival times and schedule(now) (ClockSim advances it)

    # ---- requests ---------------------------------------------------------------------------------

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4, priority: int = 0,
            deadline: float | None = None) -> Sequence:
        seq = Sequence(request_id=rid, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                       params=SamplingParams(max_tokens=max_tokens, priority=priority),
                       arrival=next(self._arrivals), arrival_time=self.clock, priority=priority)
        self.seqs[rid] = seq
        self.sched.add(seq, deadline)
        return seq

    def add_rerank(self, rid: str, prompt: list[int], priority: int = 0, *, uses_kv: bool = True,
                   wait_for: Sequence | None = None, deadline: float | None = None) -> Sequence:
        """A prefill-only pair: scored (finished) in the step that computes it; cross-encoder pairs
        (uses_kv=False) take no blocks; `wait_for` is the job's first pair, as the engine sets it."""
        seq = Sequence(request_id=rid, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                       params=RerankParams(priority=priority), arrival=next(self._arrivals),
                       arrival_time=self.clock, kind=SeqKind.RERANK, priority=priority,
                       execution=RowExec.CAUSAL if uses_kv else RowExec.ENCODER,
                       pair=RerankPair(index=0, wait_for=wait_for))
        self.seqs[rid] = seq
        self.sched.add(seq, deadline)
        return seq

    def add_embed(self, rid: str, prompt: list[int], priority: int = 0, stages: int = 1,
                  deadline: float | None = None) -> Sequence:
        """An embedding row: KV-free, done in the step that computes its last stage (stages=1: run whole)."""
        seq = Sequence(request_id=rid, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                       params=EmbedParams(priority=priority), arrival=next(self._arrivals),
                       arrival_time=self.clock, kind=SeqKind.EMBED, priority=priority, execution=RowExec.ENCODER,
                       stages=stages)
        self.seqs[rid] = seq
        self.sched.add(seq, deadline)
        return seq

    def add_rerank_job(self, rid: str, prefix: list[int], docs: list[list[int]], priority: int = 0,
                       uses_kv: bool = True, deadline: float | None = None) -> list[Sequence]:
        first = None
        pairs = []
        for i, doc in enumerate(docs):
            pair = self.add_rerank(f"{rid}/{i}", prefix + doc, priority, uses_kv=uses_kv,
                                   wait_for=first if uses_kv else None, deadline=deadline)
            first = first or pair
            pairs.append(pair)
        return pairs

    # ---- one step ---------------------------------------------------------------------------------

    def step(self) -> Batch:
        sched = self.sched
        decodes_before = [s for s in sched.running if s.num_uncomputed_tokens == 1 and s.kind is SeqKind.GENERATE]
        running_before = set(map(id, sched.running))
        batch = sched.schedule(self.clock)
        self.admissions += [s.request_id for s in batch.seqs if id(s) not in running_before]
        self.steps += 1
        self.batches.append(batch)
        self._check_batch(batch, decodes_before)
        self.preempted += [s.request_id for s in batch.preempted]

        finished: dict[Sequence, SequenceStatus] = {}
        for seq, n, stages in zip(batch.seqs, batch.num_new_tokens, batch.stages):
            if seq.request_id not in self.admitted_order:
                self.admitted_order.append(seq.request_id)
            if stages is not None:  # an encoder row: done when its last stage runs
                if stages[1] == seq.stages:
                    finished[seq] = SequenceStatus.FINISHED_STOPPED
                continue
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n) if seq.uses_kv else ():
                block = seq.block_table[pos // self.bs]
                # A block someone else also reads is never written.
                assert self.pool.ref_counts[block] == 1, (seq.request_id, pos, block)
                self.shadow[(block, pos % self.bs)] = seq.token_ids[pos]
            if seq.num_computed_tokens + n < seq.num_tokens:
                continue  # a prefill chunk: nothing sampled or scored yet
            if seq.kind is not SeqKind.GENERATE:
                finished[seq] = SequenceStatus.FINISHED_STOPPED  # scored, or embedded
            else:  # the engine's part: append the sampled token and decide there whether the sequence stops
                seq.token_ids.append(fake_token(seq.request_id, seq.num_output_tokens))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    finished[seq] = SequenceStatus.FINISHED_LENGTH
        assert batch.num_rerank_pairs_scored == sum(s.kind is SeqKind.RERANK for s in finished)  # counted once
        sched.update(batch, finished)
        self.finished_order += [s.request_id for s in finished]
        self._check_state()
        return batch

    def pending(self) -> bool:
        return bool(self.sched.running or self.sched.num_waiting)

    def run(self, max_steps: int = 20000, arrivals: dict[int, list] | None = None) -> None:
        """Step until everything finished; `arrivals` maps a step number to callables run before it."""
        arrivals = dict(arrivals or {})
        while arrivals or self.pending():
            assert self.steps < max_steps, "no progress: scheduler livelock"
            for fn in arrivals.pop(self.steps, []):
                fn()
            self.step()
        self.check_all_free()

    # ---- invariants -------------------------------------------------------------------------------

    def _check_batch(self, batch: Batch, decodes_before: list[Sequence]) -> None:
        sched, cfg = self.sched, self.cfg
        # the step's budget, or the wide one a policy may give a step of embedding rows alone
        assert batch.budget in (cfg.max_num_batched_tokens, cfg.max_embed_batch_tokens)
        assert batch.num_tokens <= batch.budget
        assert batch.budget == cfg.max_num_batched_tokens or batch.num_tokens == batch.num_embed_tokens
        assert len(batch) <= cfg.max_num_seqs
        assert len(sched.running) <= cfg.max_num_seqs
        assert len(set(map(id, batch.seqs))) == len(batch.seqs), "a sequence scheduled twice"
        assert (batch.num_decode_tokens + batch.num_prefill_tokens + batch.num_rerank_tokens
                + batch.num_embed_tokens == batch.num_tokens)
        running = set(map(id, sched.running))
        for seq, n, stages in zip(batch.seqs, batch.num_new_tokens, batch.stages):
            assert seq.status is SequenceStatus.RUNNING and id(seq) in running
            if stages is not None:  # an encoder row's stages: what they cost, from where it stopped
                assert stages[0] == seq.stages_done < stages[1] <= seq.stages
                assert n == seq.stage_tokens(stages[1] - stages[0])
                continue
            assert 1 <= n <= seq.num_uncomputed_tokens
            if seq.uses_kv:
                assert len(seq.block_table) * self.bs >= seq.num_computed_tokens + n
            else:
                assert seq.block_table == [], "a cross-encoder pair took KV blocks"
            if seq.kind is SeqKind.EMBED:
                assert n == seq.num_uncomputed_tokens, "an embedding row was split"
            if seq.kind is SeqKind.RERANK:
                if not seq.uses_kv:
                    assert n == seq.num_uncomputed_tokens, "a cross-encoder pair was split"
                assert seq.wait_for is None or seq.wait_for.status.finished
        scheduled = {id(s): n for s, n in zip(batch.seqs, batch.num_new_tokens)}
        preempted = set(map(id, batch.preempted))
        assert not preempted & set(scheduled), "a preempted sequence was also scheduled"
        for seq in decodes_before:
            assert scheduled.get(id(seq)) == 1 or id(seq) in preempted, f"decode of {seq.request_id} skipped"

    def _check_state(self) -> None:
        sched, pool, bs = self.sched, self.pool, self.bs
        holders = Counter()
        for seq in sched.running:
            assert seq.status is SequenceStatus.RUNNING
            assert len(set(seq.block_table)) == len(seq.block_table)
            holders.update(seq.block_table)
            assert len(seq.block_table) * bs >= seq.num_computed_tokens
            for pos in range(seq.num_computed_tokens):  # the KV this sequence attends to is its own
                assert self.shadow.get((seq.block_table[pos // bs], pos % bs)) == seq.token_ids[pos], \
                    (seq.request_id, pos)
            for i, h in enumerate(seq.block_hashes):
                content = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                assert self.hash_content.setdefault(h, content) == content
        for q in (sched.queues[SeqKind.GENERATE], sched.queues[SeqKind.RERANK]):
            for seq in q:
                assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
                assert seq.block_table == [] and seq.block_hashes == [] and seq.num_computed_tokens == 0
        assert all(rc >= 0 for rc in pool.ref_counts)
        assert [pool.ref_counts[b] for b in range(pool.num_blocks)] == [holders[b] for b in range(pool.num_blocks)]
        assert set(pool.free) == {b for b in range(pool.num_blocks) if pool.ref_counts[b] == 0}
        for h, b in pool.cached.items():
            assert pool.block_hash[b] == h
            if h in self.hash_content:  # a cached block holds the tokens its hash stands for
                assert tuple(self.shadow.get((b, j)) for j in range(bs)) == self.hash_content[h]

    def check_all_free(self) -> None:
        assert not self.sched.running and self.sched.num_waiting == 0
        assert self.pool.num_free == self.pool.num_blocks
        assert self.pool.ref_counts == [0] * self.pool.num_blocks
        for seq in self.seqs.values():
            assert seq.status.finished
            assert seq.block_table == []
            if seq.kind is SeqKind.GENERATE:
                assert seq.output_token_ids == [fake_token(seq.request_id, i) for i in range(seq.params.max_tokens)]


def step_until(sim: Sim, cond, limit: int = 500) -> Batch:
    """Step until cond() holds (checked after each step); returns the last batch."""
    for _ in range(limit):
        batch = sim.step()
        if cond():
            return batch
    raise AssertionError(f"condition not reached in {limit} steps")


def toks(n: int, start: int = 0) -> list[int]:
    return [start + i for i in range(n)]


def decode_ids(batch: Batch) -> set[str]:
    return {s.request_id for s, n in zip(batch.seqs, batch.num_new_tokens)
            if n == 1 and s.num_output_tokens > 0 and s.num_computed_tokens == s.num_tokens - 1}


# ---- random workloads --------------------------------------------------------------------------------


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(3, 40))
    budget = draw(st.integers(1, 48))
    cfg = dict(num_blocks=num_blocks, block_size=bs, budget=budget, max_seqs=draw(st.integers(1, 8)),
               aging=draw(st.sampled_from([1, 3, 10**6])), prefix_caching=draw(st.booleans()))
    capacity = num_blocks * bs
    shared = [draw(st.lists(st.integers(0, 3), max_size=12)) for _ in range(2)]
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        head = shared[draw(st.integers(0, 1))]
        tail = draw(st.lists(st.integers(0, 3), min_size=1, max_size=24))
        prompt = (head + tail)[:max(1, capacity - 1)]
        max_tokens = draw(st.integers(1, max(1, min(20, capacity - len(prompt)))))
        at, prio = draw(st.integers(0, 25)), draw(st.integers(0, 2))
        if draw(st.integers(0, 3)) == 0:  # a rerank job; the engine rejects pairs over the budget
            docs = draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=4))
            pairs = [(head + d)[:min(budget, capacity - 1)] for d in docs]
            reqs.append((at, f"j{i}", pairs, None, prio, draw(st.booleans())))
        else:
            reqs.append((at, f"r{i}", prompt, max_tokens, prio, None))
    return cfg, reqs


@settings(max_examples=50, deadline=None)
@given(workloads())
def test_random_workloads_keep_every_invariant(workload):
    cfg, reqs = workload
    sim = Sim(**cfg)
    arrivals: dict[int, list] = {}
    for at, rid, prompt, max_tokens, priority, uses_kv in reqs:
        if max_tokens is None:  # rerank job: prompt is the list of pairs
            fn = (lambda rid=rid, pairs=prompt, p=priority, kv=uses_kv:  # noqa: E731
                  sim.add_rerank_job(rid, [], pairs, p, uses_kv=kv))
        else:
            fn = (lambda rid=rid, prompt=prompt, m=max_tokens, p=priority: sim.add(rid, prompt, m, p))  # noqa: E731
        arrivals.setdefault(at, []).append(fn)
    sim.run(arrivals=arrivals)  # checks every step; at the end: all finished, all blocks free
    expected = sum(len(r[2]) if r[3] is None else 1 for r in reqs)
    assert len(sim.finished_order) == expected


def test_a_pair_part_way_through_goes_on_when_a_more_urgent_one_cannot_get_its_blocks():
    """A pair with one token left holds 2 of the 5 blocks; a more urgent pair needs 3 and the admission watermark
    leaves it 2: the running pair still computes its last token (its blocks were reserved at admission) and frees its
    blocks, then the urgent one runs. (Hypothesis found the livelock: every step empty, the urgent head refused and the
    running pair never chosen.)"""
    sim = Sim(num_blocks=5, block_size=4, budget=7, max_seqs=3)
    first = sim.add_rerank("late", toks(8, 100), priority=2)
    sim.step()
    assert first.num_computed_tokens == 7 and len(first.block_table) == 2
    sim.add_rerank("urgent", toks(9, 300), priority=0)
    batch = sim.step()
    assert [s.request_id for s in batch.seqs] == ["late"] and first.status.finished
    sim.run()
    assert sim.finished_order == ["late", "urgent"]


# ---- decodes are never starved by prefills -----------------------------------------------------------


def test_every_running_decode_is_scheduled_every_step():
    sim = Sim(num_blocks=256, budget=16)
    for i, n in enumerate([3, 40, 7, 25, 1, 60]):
        sim.add(f"s{i}", toks(n, 10 * i), max_tokens=12)
    while sim.pending():
        assert sim.steps < 500
        running_decodes = {s.request_id for s in sim.sched.running if s.num_uncomputed_tokens == 1}
        batch = sim.step()
        assert not batch.preempted
        assert running_decodes <= {s.request_id for s in batch.seqs}
        # Decodes come first in the batch, each one token.
        k = len(running_decodes)
        assert {s.request_id for s in batch.seqs[:k]} == running_decodes
        assert batch.num_new_tokens[:k] == [1] * k
    sim.check_all_free()


def test_long_prompt_delays_running_decodes_by_at_most_one_chunk():
    budget = 32
    sim = Sim(num_blocks=256, budget=budget)
    short = [sim.add(f"d{i}", toks(3, 100 * i), max_tokens=60) for i in range(4)]
    sim.step()  # the four prefills
    assert all(s.num_uncomputed_tokens == 1 for s in short)
    long = sim.add("long", toks(200, 5000), max_tokens=5)
    chunks = []
    while long.num_output_tokens == 0:
        assert sim.steps < 50
        outs_before = [s.num_output_tokens for s in short]
        batch = sim.step()
        assert batch.num_tokens <= budget
        assert decode_ids(batch) == {s.request_id for s in short}  # no decode waits for the prompt
        assert [s.num_output_tokens for s in short] == [o + 1 for o in outs_before]
        chunks += [n for s, n in zip(batch.seqs, batch.num_new_tokens) if s is long]
    assert chunks == [28] * 7 + [4]  # the budget left over by the decodes, every step
    assert sum(chunks) == 200
    sim.run()


def test_chunked_prefill_progresses_across_steps():
    sim = Sim(num_blocks=64, budget=32, block_size=4)
    seq = sim.add("a", toks(100), max_tokens=3)
    progress = []
    for _ in range(4):
        batch = sim.step()
        assert batch.seqs == [seq]
        progress.append((batch.num_new_tokens[0], seq.num_computed_tokens, seq.num_output_tokens))
        # The whole prompt's blocks are reserved at admission.
        assert len(seq.block_table) == 25
    assert progress == [(32, 32, 0), (32, 64, 0), (32, 96, 0), (4, 100, 1)]
    batch = sim.step()
    assert batch.num_new_tokens == [1] and batch.num_decode_tokens == 1
    sim.run()
    assert seq.output_token_ids == [fake_token("a", i) for i in range(3)]


def test_chunked_prefill_shares_the_budget_with_a_second_prompt():
    sim = Sim(num_blocks=64, budget=16, block_size=4)
    a = sim.add("a", toks(20), max_tokens=2)
    b = sim.add("b", toks(20, 100), max_tokens=2)
    b1 = sim.step()
    assert [(s.request_id, n) for s, n in zip(b1.seqs, b1.num_new_tokens)] == [("a", 16)]
    b2 = sim.step()
    assert [(s.request_id, n) for s, n in zip(b2.seqs, b2.num_new_tokens)] == [("a", 4), ("b", 12)]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0
    sim.run()


# ---- preemption ----------------------------------------------------------------------------------------


def test_preemption_picks_lowest_priority_then_newest_and_victims_resume():
    # 7 blocks of 4 (watermark 1): three 7-token prompts fit, their decodes soon do not.
    sim = Sim(num_blocks=7, block_size=4, budget=64)
    a = sim.add("a", toks(7, 10), max_tokens=20, priority=1)  # oldest, but lowest priority
    b = sim.add("b", toks(7, 20), max_tokens=20, priority=0)
    c = sim.add("c", toks(7, 30), max_tokens=20, priority=0)  # newest of the high class
    first = step_until(sim, lambda: sim.preempted)
    assert [s.request_id for s in first.preempted] == ["a"]
    assert a.status is SequenceStatus.PREEMPTED and a.num_preemptions == 1
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert a in list(sim.sched.queues[SeqKind.GENERATE])
    assert {"b", "c"} <= decode_ids(first)  # the survivors decoded in the same step
    batch = step_until(sim, lambda: len(sim.preempted) >= 2)
    assert sim.preempted == ["a", "c"]  # equal priority: the newer one goes
    assert [s.request_id for s in batch.preempted] == ["c"] and c.block_table == []
    sim.run()
    assert sim.sched.num_preemptions == len(sim.preempted)
    for s in (a, b, c):  # every victim was resumed and completed with exactly its tokens
        assert s.status is SequenceStatus.FINISHED_LENGTH
        assert s.output_token_ids == [fake_token(s.request_id, i) for i in range(20)]
    assert sim.finished_order[0] == "b"


def test_preempted_sequence_keeps_its_place_in_its_class():
    sim = Sim(num_blocks=7, block_size=4, budget=64)
    sim.add("x", toks(7, 10), max_tokens=20)
    sim.add("y", toks(7, 20), max_tokens=20)
    step_until(sim, lambda: sim.preempted)
    assert sim.preempted == ["y"]
    late = sim.add("late", toks(3, 90), max_tokens=1)  # same class, arrives after y
    sim.run()
    assert sim.admissions == ["x", "y", "y", "late"]
    assert late.status is SequenceStatus.FINISHED_LENGTH


def test_preemption_recompute_uses_prefix_cache_and_without_cache_recomputes_all():
    for caching in (True, False):
        sim = Sim(num_blocks=7, block_size=4, budget=64, prefix_caching=caching)
        sim.add("p", toks(9, 10), max_tokens=14)
        q = sim.add("q", toks(9, 40), max_tokens=14)
        step_until(sim, lambda: sim.preempted)
        assert sim.preempted == ["q"]
        computed_before = q.num_tokens  # all of it must be recomputed or found in the cache
        resumed = step_until(sim, lambda: q.status is SequenceStatus.RUNNING)
        n = dict(zip((s.request_id for s in resumed.seqs), resumed.num_new_tokens))["q"]
        if caching:
            assert resumed.num_cached_tokens > 0 and n < computed_before
        else:
            assert resumed.num_cached_tokens == 0 and n == computed_before
        sim.run()


def test_a_step_that_preempts_admits_nobody_so_the_victim_is_not_rerun_at_once():
    """Hypothesis found it (tiny pool, one-token blocks, prefix caching): r1 was preempted for r0's decode and, its
    prompt blocks still in the prefix cache, re-admitted and scheduled in that same step."""
    sim = Sim(num_blocks=11, block_size=1, budget=6, max_seqs=2, aging=1, prefix_caching=True)
    sim.add("r0", [0] * 5, max_tokens=3)
    r1 = sim.add("r1", [0] * 5, max_tokens=2)
    batch = step_until(sim, lambda: sim.preempted)  # _check_batch: no sequence both preempted and scheduled
    assert [s.request_id for s in batch.preempted] == ["r1"] and not any(s is r1 for s in batch.seqs)
    resumed = sim.step()  # the next step takes it back, its prompt from the cache
    assert any(s is r1 for s in resumed.seqs) and resumed.num_cached_tokens > 0
    sim.run()
    assert sorted(sim.finished_order) == ["r0", "r1"]


# ---- admission order -----------------------------------------------------------------------------------


def test_admission_by_priority_then_fifo():
    sim = Sim(num_blocks=64, budget=32, max_seqs=1)
    spec = [("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", 2), ("f", 1), ("g", 0), ("h", -1)]
    for rid, prio in spec:
        sim.add(rid, toks(5, ord(rid)), max_tokens=2, priority=prio)
    sim.run()
    assert sim.admitted_order == ["h", "b", "d", "g", "c", "f", "a", "e"]


def test_fifo_within_class_with_many_admitted_per_step():
    sim = Sim(num_blocks=256, budget=12, max_seqs=64)
    for i in range(10):
        sim.add(f"r{i}", toks(5, 10 * i), max_tokens=1)
    sim.run()
    assert sim.admitted_order == [f"r{i}" for i in range(10)]
    assert sim.finished_order == [f"r{i}" for i in range(10)]


def test_high_priority_arrival_overtakes_queued_low_priority():
    sim = Sim(num_blocks=64, budget=32, max_seqs=1)
    sim.add("busy", toks(3), max_tokens=3)
    sim.add("low", toks(3, 50), max_tokens=1, priority=3)
    sim.step()
    sim.add("high", toks(3, 80), max_tokens=1, priority=0)
    sim.run()
    assert sim.admitted_order == ["busy", "high", "low"]


def _starvation_run(aging: int, steps: int = 150) -> Sim:
    sim = Sim(num_blocks=64, budget=32, max_seqs=1, aging=aging)
    sim.add("low", toks(2, 7), max_tokens=1, priority=5)
    for i in range(steps):
        sim.add(f"hi{i}", toks(2, 100 + i), max_tokens=1, priority=0)  # a new high request every step
        sim.step()
    return sim


def test_aging_admits_low_priority_despite_a_steady_stream_of_high_priority():
    sim = _starvation_run(aging=4)
    assert sim.seqs["low"].status is SequenceStatus.FINISHED_LENGTH
    at = sim.admitted_order.index("low")
    assert at <= 5 * 4 + 2  # five levels to climb, one per 4 steps waited
    assert at > 0  # it did not simply jump the queue
    # Control: without aging the same load starves it.
    control = _starvation_run(aging=10**6)
    assert control.seqs["low"].status is SequenceStatus.WAITING
    assert "low" not in control.admitted_order


# ---- prefix cache through the scheduler ----------------------------------------------------------------


def test_admission_reuses_cached_prefix():
    sim = Sim(num_blocks=64, budget=64, block_size=4)
    prompt = toks(21, 300)
    first = sim.add("first", prompt, max_tokens=2)
    sim.run()
    assert first.num_cached_tokens == 0
    second = sim.add("second", prompt + [1, 2], max_tokens=2)
    batch = sim.step()
    assert batch.num_cached_tokens == 20 and second.num_cached_tokens == 20
    assert batch.num_new_tokens == [3] and batch.num_prefill_tokens == 3
    sim.run()


def test_concurrent_identical_prompts_share_blocks():
    sim = Sim(num_blocks=64, budget=64, block_size=4)
    prompt = toks(17, 300)
    a = sim.add("a", prompt, max_tokens=6)
    sim.step()
    b = sim.add("b", prompt, max_tokens=6)
    sim.step()
    assert b.num_cached_tokens == 16
    assert b.block_table[:4] == a.block_table[:4]
    assert all(sim.pool.ref_counts[x] == 2 for x in a.block_table[:4])
    sim.run()


# ---- finishing (aborts) --------------------------------------------------------------------------------


def test_finish_waiting_running_and_preempted_sequences_frees_everything():
    sim = Sim(num_blocks=7, block_size=4, budget=64)
    a = sim.add("a", toks(7, 10), max_tokens=20)
    b = sim.add("b", toks(7, 20), max_tokens=20)
    c = sim.add("c", toks(7, 30), max_tokens=20)
    w = sim.add("w", toks(30, 40), max_tokens=20)  # cannot be admitted yet
    step_until(sim, lambda: sim.preempted)
    assert c.status is SequenceStatus.PREEMPTED
    for s in (w, c, b, a):
        sim.sched.finish(s, SequenceStatus.FINISHED_ABORTED)
        assert s.status is SequenceStatus.FINISHED_ABORTED and s.block_table == []
    assert not sim.pending()
    assert sim.pool.num_free == sim.pool.num_blocks and sim.pool.ref_counts == [0] * 7
    assert sim.sched.schedule().seqs == []


@pytest.mark.parametrize("uses_kv", [True, False])
def test_rerank_pairs_are_atomic_and_leave_no_blocks(uses_kv):
    sim = Sim(num_blocks=64, budget=16, block_size=4)
    sim.add("gen", toks(3), max_tokens=10)
    pairs = sim.add_rerank_job("job", toks(8, 500), [toks(5, 100 * i) for i in range(5)], uses_kv=uses_kv)
    sim.run()  # checks each pair is scheduled whole, in one step
    for p in pairs:
        assert p.status is SequenceStatus.FINISHED_STOPPED
        assert p.output_token_ids == []
    if uses_kv:  # later pairs waited for the first and reused its query prefix
        assert pairs[0].num_cached_tokens == 0
        assert all(p.num_cached_tokens == 8 for p in pairs[1:])
        assert sim.admissions.index("job/0") < min(sim.admissions.index(p.request_id) for p in pairs[1:])
    assert sim.finished_order.index("gen") > sim.finished_order.index("job/0")  # shared the steps


def test_scoring_share_bounds_rerank_tokens_in_steps_with_decodes():
    """While decodes run, rerank pairs get at most scoring_share of the remaining budget (or one whole pair),
    so a rerank flood slows decodes by a bounded amount; steps without decodes take all the rerank they can."""
    sim = Sim(num_blocks=256, budget=40, block_size=4, max_seqs=64, scoring_share=0.25)
    for i in range(4):
        sim.add(f"gen{i}", toks(3, 10 * i), max_tokens=30)
    sim.add_rerank_job("flood", [], [toks(3, 300 + 5 * i) for i in range(60)], uses_kv=False)
    sim.add_rerank("big", toks(20, 900), uses_kv=False)
    sim.run()
    for batch in sim.batches:
        if batch.num_decode_tokens and batch.num_rerank_tokens:
            remaining = sim.cfg.max_num_batched_tokens - batch.num_decode_tokens - batch.num_prefill_tokens
            largest_pair = max(n for s, n in zip(batch.seqs, batch.num_new_tokens) if s.kind is SeqKind.RERANK)
            assert batch.num_rerank_tokens <= max(int(remaining * 0.25), largest_pair)
    decode_steps = [b for b in sim.batches if b.num_decode_tokens]
    assert any(b.num_rerank_tokens for b in decode_steps)  # rerank still progresses beside the decodes
    assert max(b.num_rerank_tokens for b in sim.batches if not b.num_decode_tokens) > 10  # and fills idle steps


# ---- a sequence that outgrows the whole KV pool ------------------------------------------------------


def test_generation_longer_than_the_kv_pool_finishes_instead_of_hanging():
    """2 blocks of 4 hold 8 tokens. A 5-token prompt with max_tokens=100 passes admission (the prompt
    fits), decodes to 8 tokens, then needs a 3rd block: the scheduler preempts it (it is the only
    victim) and can never re-admit it (3 blocks > 2), so the engine steps forever with the request
    stuck in `waiting`, and `LLM.generate` never returns. Expected: it finishes with "length" once the
    pool is full (or add_request refuses it with a ValueError)."""
    from engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(num_kv_blocks=2, block_size=4))
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    try:
        engine.add_request("r", [1, 2, 3, 4, 5], params)
    except ValueError:
        return
    final = None
    for _ in range(60):  # at most 4 steps compute anything; the rest are empty
        final = next((o for o in engine.step() if o.finished), None)
        if final is not None:
            break
    assert final is not None, f"no progress after 60 steps: {engine.stats()}"
    assert final.finish_reason == "length"
    assert final.completion_tokens <= 8 - 5
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and not engine.has_unfinished()


# ---- seats: a rerank flood leaves generation room to start -------------------------------------------


def _rerank_ids(batch: Batch) -> list[str]:
    return [s.request_id for s in batch.seqs if s.kind is SeqKind.RERANK]


def _flood(sim: Sim, n: int = 100, uses_kv: bool = True) -> list[Sequence]:
    """A rerank job whose pairs cost 4 new tokens each (the 8-token query prefix is shared), so with a large
    budget only max_num_seqs limits how many pairs one step takes."""
    return sim.add_rerank_job("flood", toks(8, 500), [toks(4, 1000 + 4 * i) for i in range(n)], uses_kv=uses_kv)


@pytest.mark.parametrize("uses_kv", [True, False])
def test_generation_arriving_during_a_rerank_flood_starts_the_next_step(uses_kv):
    """max_num_seqs=8 and a 100-document job admitted first: before the seat bound, every step's 8 seats went
    to pairs (the token share never binds: 8 pairs are 32 of 256 tokens) and the chat waited ~12 steps."""
    sim = Sim(num_blocks=512, budget=256, block_size=4, max_seqs=8)
    pairs = _flood(sim, uses_kv=uses_kv)
    sim.step()
    flooded = sim.step()
    assert len(_rerank_ids(flooded)) == 8  # alone, rerank takes every seat
    chat = sim.add("chat", toks(5, 9000), max_tokens=4)
    batch = sim.step()
    assert chat in batch.seqs  # the very next step
    before_chat = _rerank_ids(Batch(seqs=batch.seqs[:batch.seqs.index(chat)]))
    assert 1 <= len(before_chat) <= 4  # int(0.5 * 8): rerank's share first, then the chat,
    assert len(batch) == 8  # then (no decodes in this step) pairs fill the seats the chat did not need
    sim.run()
    assert all(p.status is SequenceStatus.FINISHED_STOPPED for p in pairs)
    assert chat.status is SequenceStatus.FINISHED_LENGTH


def test_rerank_alone_uses_every_seat():
    sim = Sim(num_blocks=512, budget=256, block_size=4, max_seqs=8)
    _flood(sim)
    sim.run()
    sizes = [len(_rerank_ids(b)) for b in sim.batches]
    assert sizes == [1] + [8] * 12 + [3]  # the first pair fills the shared prefix; then full steps


@pytest.mark.parametrize("share,seats", [(0.1, 1), (0.25, 2), (0.5, 4), (0.75, 6), (1.0, 8)])
def test_rerank_seats_while_generation_waits_follow_scoring_share(share, seats):
    """While a generation waits, rerank pairs get max(1, int(scoring_share * free seats)); generation the rest.
    scoring_share=1.0 gives rerank everything, as it does with the token budget."""
    sim = Sim(num_blocks=512, budget=256, block_size=4, max_seqs=8, scoring_share=share)
    _flood(sim, uses_kv=False)
    chats = [sim.add(f"chat{i}", toks(3, 9000 + 10 * i), max_tokens=50) for i in range(8)]
    batch = sim.step()
    assert len(_rerank_ids(batch)) == seats
    assert [s for s in batch.seqs if s.kind is SeqKind.GENERATE] == chats[:8 - seats]
    sim.run()


def test_scoring_share_of_seats_counts_only_free_seats():
    """Running generations hold 6 of 8 seats: of the 2 free ones rerank gets one (never zero, so it cannot
    starve) and the waiting chat the other, instead of rerank taking both."""
    sim = Sim(num_blocks=512, budget=256, block_size=4, max_seqs=8)
    long = [sim.add(f"long{i}", toks(3, 100 * i), max_tokens=40) for i in range(6)]
    sim.step()
    _flood(sim, uses_kv=False)
    chat = sim.add("chat", toks(5, 9000), max_tokens=4)
    batch = sim.step()
    assert decode_ids(batch) == {s.request_id for s in long}
    assert len(_rerank_ids(batch)) == 1 and chat in batch.seqs
    sim.run()


@pytest.mark.parametrize("uses_kv", [True, False])
def test_stream_of_generation_does_not_stop_rerank_and_rerank_does_not_stop_generation(uses_kv):
    """A new chat every 2 steps, each holding its seat for 13 steps (so chats alone keep 6-7 of the 8 seats)
    beside a 100-document job: every step with a free seat scores at least one pair, the job finishes while
    chats keep coming, and no chat waits long for a seat. With KV, the pairs first wait for the one that
    fills their shared prefix."""
    sim = Sim(num_blocks=1024, budget=256, block_size=4, max_seqs=8)
    pairs = _flood(sim, uses_kv=uses_kv)
    arrived: dict[str, int] = {}
    for i in range(300):
        if i % 2 == 0:
            rid = f"chat{i // 2}"
            sim.add(rid, toks(3, 10_000 + 7 * i), max_tokens=12)
            arrived[rid] = sim.steps
        free = sim.cfg.max_num_seqs - len(sim.sched.running)
        rerank_ready = any(p.status is SequenceStatus.WAITING and (p.wait_for is None or p.wait_for.status.finished)
                           for p in pairs)
        batch = sim.step()
        if free and rerank_ready:
            assert _rerank_ids(batch), f"step {sim.steps}: a free seat and no pair scored"
    assert all(p.status is SequenceStatus.FINISHED_STOPPED for p in pairs)
    last_pair = max(sim.finished_order.index(p.request_id) for p in pairs)
    assert last_pair < sim.finished_order.index("chat100")
    sim.run()
    first_step: dict[str, int] = {}
    for n, batch in enumerate(sim.batches):
        for s in batch.seqs:
            first_step.setdefault(s.request_id, n)
    waits = [first_step[rid] - arrived[rid] for rid in arrived]
    assert max(waits) <= 4, waits


# ---- admission policies are objects the config hands the scheduler ----------------------------------------------


class RerankFirstTwoSeats(AdmissionPolicy):
    """A test policy: while pairs wait, admit at most two of them and no prompt; then prompts."""

    def __init__(self) -> None:
        self.seen: list[StepView] = []

    def plan(self, view: StepView) -> Quota:
        self.seen.append(view)
        if view.of(TokenKind.CROSS_ENCODER):
            return Quota((Grant(None, None, 2),))
        return Quota((Grant(TokenKind.PREFILL),))


def test_the_admission_policy_handed_to_the_scheduler_decides_the_split():
    policy = RerankFirstTwoSeats()
    sim = Sim(num_blocks=256, budget=64, block_size=4, max_seqs=8, admission=policy)
    chat = sim.add("chat", toks(5, 7000), max_tokens=3)
    pairs = sim.add_rerank_job("job", [], [toks(3, 100 + 5 * i) for i in range(5)], uses_kv=False)
    first = sim.step()
    view = policy.seen[0]
    assert (view.budget, view.free_seats) == (64, 8)
    assert [(w.kind, w.tokens, w.unit) for w in view.waiting] == [(TokenKind.PREFILL, 5, 5),
                                                                  (TokenKind.CROSS_ENCODER, 15, 3)]
    assert [s.request_id for s in first.seqs] == ["job/0", "job/1"]
    sim.run()
    assert sim.admitted_order.index("chat") > max(sim.admitted_order.index(p.request_id) for p in pairs)
    assert chat.status is SequenceStatus.FINISHED_LENGTH


def test_an_admission_that_is_not_a_policy_is_rejected():
    kv = KVCacheManager(BlockPool(16), 4, True)
    with pytest.raises(ValueError, match="admission must be an AdmissionPolicy"):
        Scheduler(EngineConfig(num_kv_blocks=16, block_size=4), kv, lambda step: None)


def test_embedding_rows_run_whole_beside_generation_and_pairs_and_take_no_blocks():
    sim = Sim(num_blocks=64, budget=16, block_size=4)
    sim.add("gen", toks(3), max_tokens=10)
    pairs = sim.add_rerank_job("job", toks(4, 500), [toks(5, 100 * i) for i in range(3)], uses_kv=False)
    rows = [sim.add_embed(f"emb/{i}", toks(6, 700 + 10 * i)) for i in range(4)]
    sim.run()  # checks every row and pair is scheduled whole, in one step
    assert all(s.status is SequenceStatus.FINISHED_STOPPED and not s.block_table for s in pairs + rows)
    with_rows = [b for b in sim.batches if b.num_embed_rows]
    assert sum(b.num_embed_rows for b in with_rows) == 4 and sum(b.num_embed_tokens for b in with_rows) == 24
    assert all(b.num_rerank_pairs == sum(s.kind is SeqKind.RERANK for s in b.seqs) for b in sim.batches)
    assert any(b.num_embed_rows and b.num_decode_tokens for b in sim.batches)  # shared steps with the decodes
    assert sim.finished_order.index("gen") > sim.finished_order.index("emb/0")


class _OneKindFirst(AdmissionPolicy):
    """Admits the scoring queue's cross-encoder pairs only, then asks again for embedding rows: the scheduler must
    stop at the head that changes kind."""

    def plan(self, view: StepView) -> Quota:
        return Quota((Grant(TokenKind.CROSS_ENCODER, 100), Grant(TokenKind.EMBED, 100)))


def test_an_admission_sized_for_one_kind_stops_where_the_queue_changes_kind():
    policy = _OneKindFirst()
    sim = Sim(num_blocks=64, budget=64, block_size=4, admission=policy)
    sim.add_rerank_job("job", toks(2, 500), [toks(3, 100 * i) for i in range(2)], uses_kv=False)
    sim.add_embed("emb", toks(4, 700))
    batch = sim.step()
    assert [s.request_id for s in batch.seqs] == ["job/0", "job/1", "emb"]
    assert (batch.num_cross_encoder_tokens, batch.num_embed_tokens) == (10, 4)


def test_a_decode_short_of_a_block_never_preempts_an_encoder_row_part_way_through_its_stages():
    # Rows hold no blocks: preempting one frees nothing and would throw its stages away. 7 blocks of 4: the three
    # chats' decodes soon need a block, while rows too long for the step's budget run a few stages a step beside them.
    sim = Sim(num_blocks=7, block_size=4, budget=16)
    chats = [sim.add(c, toks(7, 10 * i), max_tokens=20) for i, c in enumerate("abc")]
    sim.step()
    rows = [sim.add_embed(f"emb/{i}", toks(24, 500 + 40 * i), stages=6) for i in range(3)]
    sim.run()
    assert sim.preempted  # the decodes did run short of blocks
    assert not any(r.startswith("emb") for r in sim.preempted)
    assert all(r.status is SequenceStatus.FINISHED_STOPPED and r.stages_done == 6 for r in rows)
    assert any(b.stages[i] is not None and b.stages[i][1] - b.stages[i][0] < 6
               for b in sim.batches for i in range(len(b)))  # some row really ran part of its stages in a step
    assert all(c.status is SequenceStatus.FINISHED_LENGTH for c in chats)
