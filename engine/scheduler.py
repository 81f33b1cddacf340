"""Iteration-level scheduling: each step, one ragged batch under a token budget.

Order: running decodes (one token each), then chunked-prefill continuations, then admissions from
the waiting queues (generation and rerank pairs, shared by a fairness policy). A sequence's whole
prompt gets its blocks at admission, so only decodes grow; a decode that finds no free block
preempts the lowest-priority, newest running sequence (recomputed later).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.request import Sequence, SequenceStatus, SeqKind


@dataclass(slots=True)
class Batch:
    """What one step computes: for each sequence, its next num_new_tokens tokens."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens that newly admitted sequences took from the prefix cache
    num_rerank_pairs: int = 0
    num_rerank_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    decode_request_ids: list[str] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        if seq.kind is SeqKind.RERANK:
            self.num_rerank_pairs += 1
            self.num_rerank_tokens += n
        elif n == 1 and seq.num_output_tokens > 0 and seq.num_computed_tokens == seq.num_tokens - 1:
            self.num_decode_tokens += 1
            self.decode_request_ids.append(seq.request_id)
        else:
            self.num_prefill_tokens += n

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class WaitQueue:
    """Priority classes, FIFO inside each; a class head gains one level per `aging_steps` steps waited."""

    def __init__(self, aging_steps: int) -> None:
        self.aging_steps = aging_steps
        self._classes: dict[int, list[tuple[int, Sequence]]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        for heap in self._classes.values():
            for _, seq in heap:
                yield seq

    def push(self, seq: Sequence, step: int) -> None:
        seq.waiting_since_step = step
        heapq.heappush(self._classes.setdefault(seq.priority, []), (seq.arrival, seq))
        self._len += 1

    def peek(self, step: int) -> Sequence | None:
        best, best_key = None, None
        for heap in self._classes.values():
            if not heap:
                continue
            head = heap[0][1]
            key = (head.priority - (step - head.waiting_since_step) // self.aging_steps, head.arrival)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def pop(self, seq: Sequence) -> None:
        """Remove `seq`, which must be the head of its class (as `peek` returned it)."""
        heapq.heappop(self._classes[seq.priority])
        self._len -= 1

    def remove(self, seq: Sequence) -> bool:
        heap = self._classes.get(seq.priority, [])
        for i, (_, s) in enumerate(heap):
            if s is seq:
                heap[i] = heap[-1]
                heap.pop()
                heapq.heapify(heap)
                self._len -= 1
                return True
        return False


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.kv = kv
        self.budget = config.max_num_batched_tokens
        # Every running sequence must fit in one step's budget, or decodes could be skipped.
        self.max_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.rerank_share = config.rerank_share
        self.static = config.scheduling == "static"
        self.watermark = max(1, kv.pool.num_blocks // 100)  # headroom admissions leave for decodes
        self.waiting = WaitQueue(config.priority_aging_steps)
        self.waiting_rerank = WaitQueue(config.priority_aging_steps)
        self.running: list[Sequence] = []
        self.step = 0
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._queue_of(seq).push(seq, self.step)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take a sequence out of the scheduler for good and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif not seq.status.finished:
            self._queue_of(seq).remove(seq)
        if seq.block_table:
            self.kv.free(seq)
        seq.status = status

    def has_unfinished(self) -> bool:
        return bool(self.running or len(self.waiting) or len(self.waiting_rerank))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_rerank)

    def _queue_of(self, seq: Sequence) -> WaitQueue:
        return self.waiting_rerank if seq.kind is SeqKind.RERANK else self.waiting

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> Batch:
        self.step += 1
        batch = Batch()
        self.running.sort(key=lambda s: (s.priority, s.arrival))
        budget = self._schedule_decodes(batch, self.budget)
        budget = self._schedule_prefill_chunks(batch, budget)
        if not (self.static and self.running):
            self._admit(batch, budget)
        return batch

    def _schedule_decodes(self, batch: Batch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_uncomputed_tokens != 1:
                i += 1
                continue
            while not self.kv.allocate(seq, 1):
                victim = self.running[-1]  # lowest priority, newest; not scheduled yet (we go best-first)
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                batch.add(seq, 1)
                budget -= 1
                i += 1
        return budget

    def _schedule_prefill_chunks(self, batch: Batch, budget: int) -> int:
        for seq in self.running:
            if budget <= 0:
                break
            n = seq.num_uncomputed_tokens
            if n > 1:  # blocks were reserved at admission
                chunk = min(n, budget)
                batch.add(seq, chunk)
                budget -= chunk
        return budget

    def _admit(self, batch: Batch, budget: int) -> None:
        gen, rerank = self.waiting, self.waiting_rerank
        if len(rerank) and (len(gen) or batch.num_decode_tokens):
            # Generation needs this step too (prompts wait, or decodes ride in it, whose time per output token
            # grows with every rerank token added): rerank gets its share of what is left, of the token budget
            # and of the free seats, and always room for one pair, so a long pair cannot starve. The seat share
            # lets a new prompt start at once beside a rerank flood; pairs are scored (and leave) in the step
            # that admits them, so it never holds back a pair already running or a job's shared-prefix pair.
            head = rerank.peek(self.step)
            cap = max(int(budget * self.rerank_share), head.num_tokens if head else 0)
            seats = max(1, int((self.max_seqs - len(self.running)) * self.rerank_share))
            budget -= self._admit_from(rerank, batch, min(cap, budget), seats)
            budget -= self._admit_from(gen, batch, budget)
            if not batch.num_decode_tokens:
                self._admit_from(rerank, batch, budget)
        elif len(gen):
            self._admit_from(gen, batch, budget)
        elif len(rerank):
            self._admit_from(rerank, batch, budget)

    def _admit_from(self, queue: WaitQueue, batch: Batch, budget: int, seats: int | None = None) -> int:
        """Admit from the head of `queue` while `budget` tokens and (at most `seats` new) seats last."""
        used = 0
        max_running = self.max_seqs if seats is None else min(self.max_seqs, len(self.running) + seats)
        while used < budget and len(self.running) < max_running:
            seq = queue.peek(self.step)
            if seq is None or (seq.wait_for is not None and not seq.wait_for.status.finished):
                break
            cached = self.kv.match_prefix(seq) if seq.uses_kv else 0
            n = seq.num_uncomputed_tokens
            atomic_misfit = seq.kind is SeqKind.RERANK and n > budget - used
            if atomic_misfit or (seq.uses_kv and not self._has_room(seq, n)):
                if seq.block_table:
                    self.kv.free(seq)
                seq.num_computed_tokens = 0
                break
            if seq.uses_kv:
                self.kv.allocate(seq, n)
            queue.pop(seq)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            batch.num_cached_tokens += cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunk = min(n, budget - used)
            batch.add(seq, chunk)
            used += chunk
        return used

    def _has_room(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.kv.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        free = self.kv.pool.num_free
        return need <= free - self.watermark or (need <= free and not self.running)

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.prompt_logprobs.clear()  # recomputed with the prompt
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(seq)
        self._queue_of(seq).push(seq, self.step)
        seq.status = SequenceStatus.PREEMPTED

    def update(self, batch: Batch, sampled: list[int | None]) -> None:
        """Advance each scheduled sequence past the tokens it computed, appending its sampled token."""
        for seq, n, token in zip(batch.seqs, batch.num_new_tokens, sampled):
            seq.num_computed_tokens += n
            if seq.uses_kv:
                self.kv.commit(seq)
            if token is not None:
                seq.token_ids.append(token)
