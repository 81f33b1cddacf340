"""Iteration-level scheduling: each step, one ragged batch under a token budget.

Order: running decodes (one token each), then chunked-prefill continuations of prompts, then what the admission
policy gives out: prompt admissions and scoring tokens (pairs the LLM scores continue in chunks, exactly like prompts,
before new pairs are admitted; a cross-encoder pair or an embedding row runs whole or a few of its layers a step). A
sequence's whole prompt (a pair's whole text)
gets its blocks at admission, so only decodes grow; a decode that finds no free block
preempts the lowest-priority, newest running sequence (recomputed later; that step admits nobody). A sequence
that shares another's prompt (`Sequence.blocked`: rerank pairs after their job's first, completions 1..n-1 after
completion 0) is admitted once that one has computed it, and then takes its full blocks from the prefix cache or as
a fork.
"""
from __future__ import annotations

import heapq
import math
import time
from collections.abc import Mapping

from engine.admission import AdmissionPolicy, StepView, Waiting
from engine.batch import Batch
from engine.config import EngineConfig
from engine.kv_cache import NO_PREFIX, CachedPrefix, KVCacheManager
from engine.request import SeqKind, Sequence, SequenceStatus
from engine.staged_states import StagedStates
from engine.step_time import StepShape, TokenKind, work_kind

__all__ = ["Batch", "Scheduler", "WaitQueue"]

# The smallest chunk of a prompt or an LLM-scored pair a step takes for the sake of progress (StepView's `unit`).
MIN_CHUNK_TOKENS = 16


class WaitQueue:
    """Priority classes; inside each, work still on time first, earliest deadline first, then late work (its deadline
    passed: it keeps its share of the steps, but no longer goes before work that can still make it), then work with no
    deadline, each in arrival order among equal deadlines (FIFO when no policy sets deadlines). A class head gains one
    level per `aging_steps` steps waited. Lateness is read at `now`, the clock schedule() was given."""

    def __init__(self, aging_steps: int) -> None:
        self.aging_steps = aging_steps
        # per class: (on-time heap, late heap), both of (deadline, arrival, seq); a row moves to late once, for good
        self._classes: dict[int, tuple[list[tuple[float, int, Sequence]], list[tuple[float, int, Sequence]]]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        for heaps in self._classes.values():
            for heap in heaps:
                for *_, seq in heap:
                    yield seq

    def push(self, seq: Sequence, step: int) -> None:
        seq.waiting_since_step = step
        heapq.heappush(self._classes.setdefault(seq.priority, ([], []))[0], (seq.deadline_key, seq.arrival, seq))
        self._len += 1

    def peek(self, step: int, now: float = -math.inf) -> Sequence | None:
        return self.peek_keyed(step, now)[1]

    def peek_keyed(self, step: int, now: float = -math.inf
                   ) -> tuple[tuple[int, int, float, int] | None, Sequence | None]:
        """The head and its order key (aged priority, late, deadline, arrival): lower keys go first, across queues
        too."""
        best, best_key = None, None
        for on_time, late in self._classes.values():
            while on_time and on_time[0][0] < now:  # its deadline passed: late from now on
                heapq.heappush(late, heapq.heappop(on_time))
            heap, is_late = (on_time, 0) if on_time else (late, 1)
            if not heap:
                continue
            head = heap[0][-1]
            key = (head.priority - (step - head.waiting_since_step) // self.aging_steps, is_late,
                   head.deadline_key, head.arrival)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best_key, best

    def pop(self, seq: Sequence) -> None:
        """Remove `seq`, which must be the head of its class (as `peek` returned it)."""
        on_time, late = self._classes[seq.priority]
        heapq.heappop(on_time if on_time and on_time[0][-1] is seq else late)
        self._len -= 1

    def remove(self, seq: Sequence) -> bool:
        for heap in self._classes.get(seq.priority, ()):
            for i, (*_, s) in enumerate(heap):
                if s is seq:
                    heap[i] = heap[-1]
                    heap.pop()
                    heapq.heapify(heap)
                    self._len -= 1
                    return True
        return False


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, policy: AdmissionPolicy,
                 staged: StagedStates | None = None) -> None:
        """`policy`: how much of each kind of work a step takes (engine/builder.py resolves it from the config);
        `staged`: the encoder rows' states between their stages (None: a new, empty one), freed here wherever KV
        blocks are."""
        self.kv = kv
        self.staged = staged if staged is not None else StagedStates()
        self.budget = config.max_num_batched_tokens
        self.embed_budget = config.max_embed_batch_tokens  # a step of embedding rows alone (the policy may widen to it)
        # Every running sequence must fit in one step's budget, or decodes could be skipped.
        self.max_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        if not isinstance(policy, AdmissionPolicy):
            raise ValueError(f"admission must be an AdmissionPolicy, got {policy!r}")
        self.policy = policy
        self.static = config.scheduling == "static"
        self.watermark = max(1, kv.num_blocks // 100)  # headroom admissions leave for decodes
        # One wait queue per kind of request: a generation's prompts, a rerank's pairs, embedding rows (a rerank's too,
        # where its mode embeds). The scoring queues (the kinds whose rows do not sample) are one priority order
        # (`_scoring_head` takes the most urgent head), kept apart so that each kind of scoring work can be given its
        # own share of a step (admission.LatencyAdmission).
        self.queues: dict[SeqKind, WaitQueue] = {kind: WaitQueue(config.priority_aging_steps) for kind in SeqKind}
        self._prompts = [q for kind, q in self.queues.items() if kind.samples]
        self._scoring = [q for kind, q in self.queues.items() if not kind.samples]
        self.running: list[Sequence] = []
        self.num_steps = 0  # schedule() calls: the clock of priority aging
        self._now = -math.inf  # the clock of deadlines at the step being scheduled (schedule()'s `now`)
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------

    def add(self, seq: Sequence, deadline: float | None = None) -> None:
        """Queue `seq`; `deadline` (its request's first result is due then, admission.AdmissionPolicy.deadline)
        orders it within its priority class and tells the policy how urgent it is. A row queued again (a later
        stage of its job) keeps the deadline it had when None is given."""
        if deadline is not None:
            seq.deadline = deadline
        seq.status = SequenceStatus.WAITING
        self._queue_of(seq).push(seq, self.num_steps)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take a sequence out of the scheduler for good and return its blocks (an encoder row: its staged states)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif not seq.status.finished:
            self._queue_of(seq).remove(seq)
        if seq.block_table:
            self.kv.free(seq)
        self.staged.free(seq)
        seq.status = status

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def _queue_of(self, seq: Sequence) -> WaitQueue:
        return self.queues[seq.kind]

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> Batch:
        """One step's batch; `now` is the clock the deadlines are on (the engine's time.monotonic(); the simulator's
        fake clock), read only to tell the policy how much slack each piece of work has."""
        self.num_steps += 1
        self._now = time.monotonic() if now is None else now
        batch = Batch(budget=self.budget)
        self.running.sort(key=lambda s: (s.priority, s.arrival))
        budget = self._schedule_decodes(batch, self.budget)
        # A step that had to preempt admits nobody (vLLM does the same): the sequences it just queued again would
        # otherwise be re-admitted at once, onto the prefix-cached blocks they just gave back, and run in the very
        # step that preempted them. A static engine admits nobody while anything runs.
        if batch.preempted or (self.static and self.running):
            self._continue_prefills(batch, budget)
            return batch
        view = self._view(batch, budget, self._now)
        quota = self.policy.plan(view)
        batch.target_s, batch.limit_s, batch.planned = quota.target_s, quota.limit_s, quota.planned
        batch.owed = quota.owed
        if quota.budget is not None and quota.budget > self.budget:
            budget += quota.budget - self.budget
            batch.budget = quota.budget
        for grant in quota.grants:
            if budget <= 0:
                break
            limit = budget if grant.tokens is None else min(grant.tokens, budget)
            if grant.kind is TokenKind.PREFILL:
                used = self._continue_prefills(batch, limit)
                for queue in self._prompts:
                    used += self._admit_from(queue, batch, limit - used, grant.seats) if limit > used else 0
            else:
                used = self._admit_scoring(batch, limit, grant.seats, grant.kind)
            budget -= used
        return batch

    def _view(self, batch: Batch, budget: int, now: float) -> StepView:
        """What the policy sees of this step: the decodes in `batch`, and per kind what waits (StepView)."""
        heads: dict[TokenKind, tuple[tuple, Sequence, int]] = {}  # kind -> (key, head, tokens)

        def offer(key: tuple, seq: Sequence, tokens: int) -> None:
            kind = work_kind(seq)
            old = heads.get(kind)
            if old is None:
                heads[kind] = (key, seq, tokens)
            else:
                heads[kind] = (min(old[0], key), old[1] if old[0] <= key else seq, old[2] + tokens)

        for seq in self.running:  # part-way through: a prompt's chunks, a pair's chunks, a row's stages
            if seq.num_uncomputed_tokens > (1 if seq.samples else 0) and not _in_batch(seq, batch):
                offer((seq.priority, *self._lateness(seq), seq.arrival), seq, seq.num_uncomputed_tokens)
        for queue in self.queues.values():
            key, head = queue.peek_keyed(self.num_steps, self._now)
            if head is not None and not head.blocked:
                offer(key, head, _tokens_up_to(queue, budget))
        waiting = []
        for kind, (key, head, tokens) in sorted(heads.items(), key=lambda kv: kv[1][0]):
            unit = self._unit(head)
            waiting.append(Waiting(kind, key[0], _urgency(kind, key, head), key[-1], unit,
                                   1 if head.uses_kv else unit, tokens, head.deadline))
        free = self.max_seqs - len(self.running)
        joining = min(sum(len(q) for q in self._prompts), free) + sum(1 for s in self.running if s.samples and not s.num_output_tokens)
        paces = tuple((s.deadline, s.num_output_tokens) for s in batch.seqs
                      if s.samples and s.deadline is not None and s.num_uncomputed_tokens == 1)
        return StepView(StepShape.of_batch(batch), batch.min_decode_priority, budget, free, tuple(waiting),
                        self.embed_budget, joining, now, paces)

    def _unit(self, seq: Sequence) -> int:
        """The smallest unit of `seq`'s work a step can take: a chunk of a prompt or an LLM-scored pair, one stage of
        an encoder row, a whole cross-encoder pair."""
        if seq.uses_kv:
            return min(seq.num_uncomputed_tokens or seq.num_tokens, MIN_CHUNK_TOKENS)
        return seq.stage_tokens(1) if seq.staged else seq.num_uncomputed_tokens or seq.num_tokens

    def _schedule_decodes(self, batch: Batch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_uncomputed_tokens != 1 or not seq.samples:
                i += 1
                continue
            while not self.kv.allocate(seq, 1):
                # lowest priority, newest, of those holding blocks (an encoder row part-way through its stages
                # holds none: preempting it would free nothing); not scheduled yet (we go best-first)
                victim = next(s for s in reversed(self.running) if s.uses_kv)
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                batch.add(seq, 1)
                budget -= 1
                i += 1
        return budget

    def _continue_prefills(self, batch: Batch, budget: int) -> int:
        """The next chunks of prompts already running (chunked prefill), most urgent first, at most `budget` tokens;
        returns the tokens taken."""
        used = 0
        for seq in self.running:
            if used >= budget:
                break
            n = seq.num_uncomputed_tokens
            if n > 1 and seq.samples and not _in_batch(seq, batch):  # blocks reserved at admission
                chunk = min(n, budget - used)
                batch.add(seq, chunk)
                used += chunk
        return used

    def _scoring_head(self, scoring: list[Sequence], batch: Batch, kind: TokenKind | None = None,
                      admitting: bool = True) -> Sequence | None:
        """The sequence the next scoring tokens go to (of `kind` only, when given: admission.work_kind): the most
        urgent of the running ones not yet in this step (part-way through: a pair's KV so far, a row's stages so far)
        and, while `admitting`, the two scoring queues' heads; at equal priority the running one."""
        waiting, best = None, None
        for queue in self._scoring if admitting else ():
            key, head = queue.peek_keyed(self.num_steps, self._now)
            if head is not None and (kind is None or work_kind(head) is kind) and (best is None or key < best):
                waiting, best = head, key
        # the most urgent running one (priority, then on time before late, then deadline; running is in (priority,
        # arrival) order)
        part_way = min((s for s in scoring if (kind is None or work_kind(s) is kind)
                        and s.num_computed_tokens < s.num_tokens and not _in_batch(s, batch)),
                       key=lambda s: (s.priority, *self._lateness(s)), default=None)
        if part_way is not None and (waiting is None or (part_way.priority, *self._lateness(part_way))
                                     <= (waiting.priority, *self._lateness(waiting))):
            return part_way
        return waiting

    def _lateness(self, seq: Sequence) -> tuple[int, float]:
        """(1 if its deadline passed else 0, its deadline): the order within a priority, as WaitQueue keeps it."""
        return (int(seq.deadline_key < self._now), seq.deadline_key)

    def _admit_scoring(self, batch: Batch, budget: int, seats: int | None, kind: TokenKind | None = None) -> int:
        """Scoring tokens (rerank pairs and embedding rows), at most `budget` of them: the next chunk (stages) of each
        running pair (row), then new ones, most urgent first (`_scoring_head`). An LLM-scored pair is chunked like a
        prompt; an encoder row (cross-encoder pair, embedding input) runs whole or its next stages
        (Sequence.stages_within). `seats` bounds the pairs and rows this call serves, running ones included (each
        holds a seat). `kind`: only work of that kind (admission.work_kind), the most urgent of it first."""
        scoring = [s for s in self.running if not s.samples]  # part-way through
        used = 0
        admitting = True  # until a queue's head cannot be admitted (no blocks, budget or seats for it)
        while used < budget and (seats is None or seats > 0):
            seq = self._scoring_head(scoring, batch, kind, admitting)
            if seq is None:
                break
            if seq.status is not SequenceStatus.RUNNING:  # a queue's head: a new pair or row
                took = self._admit_from(self._queue_of(seq), batch, budget - used, seats, one=True)
                if not took:
                    # The running ones part-way through still go on: their blocks were reserved at admission, and a
                    # pair that waits for blocks the running ones hold would otherwise wait for ever.
                    admitting = False
                    continue
                used += took
            elif seq.staged:  # an encoder row part-way through: its next stages
                k = seq.stages_within(budget - used)
                if not k:
                    break
                took = seq.stage_tokens(k)
                batch.add(seq, took, (seq.stages_done, seq.stages_done + k))
                used += took
            else:
                chunk = min(seq.num_uncomputed_tokens, budget - used)
                batch.add(seq, chunk)
                used += chunk
            seats = None if seats is None else seats - 1
        return used

    def _admit_from(self, queue: WaitQueue, batch: Batch, budget: int, seats: int | None = None,
                    one: bool = False) -> int:
        """Admit from the head of `queue` while `budget` tokens and (at most `seats` new) seats last."""
        used = 0
        max_running = self.max_seqs if seats is None else min(self.max_seqs, len(self.running) + seats)
        while used < budget and len(self.running) < max_running:
            seq = queue.peek(self.num_steps, self._now)
            if seq is None or seq.blocked:
                break
            prefix = self._prefix_of(seq) if seq.uses_kv else NO_PREFIX
            n = seq.num_tokens - prefix.num_tokens  # a waiting sequence has nothing computed
            stages = None
            if seq.staged and n > budget - used:  # an encoder row: its first stages (layers) now, the rest later
                k = seq.stages_within(budget - used)
                if not k:
                    break
                n, stages = seq.stage_tokens(k), (0, k)
            elif not seq.uses_kv and n > budget - used:
                break  # a single-stage row is atomic (bidirectional attention over the whole row)
            # Admissions leave a little headroom for decodes, unless nothing runs that could use it.
            if seq.uses_kv and not self.kv.allocate(seq, n, prefix, reserve=self.watermark if self.running else 0):
                break
            queue.pop(seq)
            seq.num_computed_tokens = prefix.num_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = prefix.num_tokens
            batch.num_cached_tokens += prefix.num_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunk = min(n, budget - used)
            batch.add(seq, chunk, stages)
            used += chunk
            if one:
                break
        return used

    def _prefix_of(self, seq: Sequence) -> CachedPrefix:
        """What seq need not compute: its fork source's prompt blocks (completions 1..n-1 of a request) or the prefix
        cache, whichever covers more (with prefix caching on they are usually the same blocks)."""
        cached = self.kv.find_cached_prefix(seq)
        if seq.fork_of is None:
            return cached
        fork = self.kv.fork_prefix(seq.fork_of, seq)
        return fork if fork.num_tokens >= cached.num_tokens else cached

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        self.staged.free(seq)  # an encoder row part-way through its stages starts again from its first
        seq.num_computed_tokens = 0
        seq.stages_done = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(seq)
        self._queue_of(seq).push(seq, self.num_steps)
        seq.status = SequenceStatus.PREEMPTED

    def preempt(self, seq: Sequence) -> None:
        """Take a running sequence's blocks (an encoder row's staged states) back now and queue it again to recompute
        (what a decode short of a block does to the lowest-priority, newest running sequence; the engine calls it
        only in tests)."""
        self._preempt(seq, Batch())

    def update(self, batch: Batch, finished: Mapping[Sequence, SequenceStatus]) -> None:
        """After the step: advance each scheduled sequence past the tokens it computed (its sampled token, if any,
        was appended by whoever decided whether it stops), then take the `finished` ones out for good."""
        for seq, n, stages in zip(batch.seqs, batch.num_new_tokens, batch.stages):
            if stages is not None:  # an encoder row: its tokens are computed once its last stage ran
                seq.stages_done = stages[1]
                if seq.stages_done == seq.stages:
                    seq.num_computed_tokens = seq.num_tokens
                continue
            seq.num_computed_tokens += n
            if seq.uses_kv:
                self.kv.commit(seq)
        for seq, status in finished.items():
            self.finish(seq, status)


def _urgency(kind: TokenKind, key: tuple, head: Sequence) -> int:
    """The priority a waiting kind is weighed against the running decodes at (below theirs: not held to the
    objective). A chat's aged one (`key[0]`) while it has no deadline or is late (`key[1]`): a chat that waited long
    enough is as urgent as those already decoding (what bounds a burst's time to first token, as in a server without
    an objective). A chat still on time is paced by its deadline instead (the policy gives it what it needs each step
    to make it): lifted by aging, it took a whole 512-token chunk in one step, a gap of ~1 s in every stream beside it.
    Scoring work's own, before aging: aging orders it among waiting work but never lifts a flood over the chats (its
    share keeps it moving; lifted, a flood that waited 64 steps took whole steps of rows at 2-5x T)."""
    aged = kind is TokenKind.PREFILL and (head.deadline is None or key[1])
    return key[0] if aged else head.priority


def _tokens_up_to(queue: WaitQueue, budget: int) -> int:
    """Tokens waiting in `queue`, counted up to a little past `budget` (all a step could take)."""
    total = 0
    for seq in queue:
        total += seq.num_tokens
        if total > budget:
            break
    return total


def _in_batch(seq: Sequence, batch: Batch) -> bool:
    return seq in batch  # by identity (Batch.__contains__), in O(1): called per running row for every admission
