"""Turns a scheduled Batch into flat tensors, runs one forward over the ragged batch, samples."""
from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.config import PoolingTask
from engine.cuda_graphs import Capture, DecodeGraphs, try_capture
from engine.embed import Embedder
from engine.models.stages import StageResult, StageWork
from engine.models.decoder import DecoderForCausalLM
from engine.rerank.scorer import PairScorer
from engine.request import RowExec, Sequence, SeqKind
from engine.sampling import sample_sequences, top_logprobs
from engine.scheduler import Batch
from engine.staged_states import StagedStates

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class RunnerOutput:
    """What one step computed, one entry per row of its Batch (same order). The runner keeps nothing of it: the
    engine applies it (LLMEngine._process) and the requests keep what accumulates."""
    sampled: list[int | None]  # the row's next token, if its prompt completed this step
    # The row's sampled token's raw log-probability and top alternatives, if its params ask.
    logprobs: list[dict[int, float] | None]
    # The log-probabilities of the prompt tokens this row's chunk predicts (positions from its logprob_start on: a
    # likelihood pair's query span, a prompt_logprobs request's prompt), in order; and, for a row that asks for
    # alternatives (num_prompt_logprobs), the top ones per position. A chunked sequence gets its span over several
    # steps' outputs.
    prompt_logprobs: list[list[float] | None]
    prompt_top_logprobs: list[list[dict[int, float]] | None]
    # What a pair's last position gives, for a pair whose last token was computed this step, in modes that score
    # there (judge, cross-encoder); the engine makes every pair's score of it and its span (PairScorer.pair_score).
    scores: list[float | None]
    # An embedding row's pooled vector (float32, not normalised: the engine finishes it per request).
    embeddings: list[torch.Tensor | None]
    forward_s: float = 0.0  # time inside model forwards (LLM and cross-encoder), the rest is engine overhead

    @classmethod
    def empty(cls, rows: int) -> "RunnerOutput":
        """Nothing computed yet for `rows` rows: every entry None."""
        return cls(sampled=[None] * rows, logprobs=[None] * rows, prompt_logprobs=[None] * rows,
                   prompt_top_logprobs=[None] * rows, scores=[None] * rows, embeddings=[None] * rows)


@dataclass(slots=True)
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    last_token_rows: list[int]  # flat index of the last token of each sequence that completes
    completing: list[int]  # batch positions of those sequences
    logprob_rows: list[int]  # flat rows whose hidden state predicts a prompt token whose log-probability is asked
    logprob_targets: list[int]  # that token, per row
    logprob_owners: list[int]  # batch position of the row's sequence


class ModelRunner:
    # Rows of prompt log-probabilities computed at once: bounds the [rows, vocab] logits a step materialises.
    LOGPROB_CHUNK = 256

    def __init__(self, model: DecoderForCausalLM, num_blocks: int, block_size: int, device: str, dtype: str,
                 scorer: PairScorer | None = None, eos_token_ids: Collection[int] = (),
                 poolers: dict[PoolingTask, Embedder] | None = None) -> None:
        a = model.args
        self.eos_token_ids = frozenset(eos_token_ids)  # masked while a sequence is short of its min_tokens
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_caches = torch.zeros(
            (a.num_layers, 2, num_blocks, block_size, a.num_kv_heads, a.head_dim),
            dtype=DTYPES[dtype], device=self.device)
        self.scorer = scorer  # the rerank mode: scores finished rerank pairs
        # Every pooling encoder by its task (EmbedParams.task): the embedder, a classifier, a sparse embedder
        self.poolers = dict(poolers or {})
        embedder = self.embedder
        # The cross-encoder and the embedder are one encoder (encoder_loader.same_encoder): one staged forward runs both
        self.shared_encoder = (embedder is not None and scorer is not None and scorer.staged is not None
                               and scorer.staged is embedder.staged)
        self.decode_graphs: DecodeGraphs | None = None  # set by capture_decode_graphs

    @property
    def embedder(self) -> Embedder | None:
        """Runs embedding rows (poolers[PoolingTask.EMBED]; None: no embedder loaded, none are admitted)."""
        return self.poolers.get(PoolingTask.EMBED)

    def capture_decode_graphs(self, sizes: list[int], max_blocks_per_seq: int, capture: Capture) -> bool:
        """From now on decode-only batches of up to max(sizes) sequences replay graphs; False if capture failed."""
        self.decode_graphs = try_capture(self.model, self.kv_caches, sizes, max_blocks_per_seq, capture)
        return self.decode_graphs is not None

    @staticmethod
    def kv_bytes_per_block(model_args, block_size: int, dtype: str) -> int:
        a = model_args
        return a.num_layers * 2 * block_size * a.num_kv_heads * a.head_dim * DTYPES[dtype].itemsize

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int]) -> PreparedBatch:
        """Flat tensors for the sequences that run through the LLM (each computes its next n tokens)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        last_rows: list[int] = []
        completing: list[int] = []
        lp_rows: list[int] = []
        lp_targets: list[int] = []
        lp_owners: list[int] = []
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            tables.append(table)
            if end == seq.num_tokens:
                last_rows.append(query_start[-1] - 1)
                completing.append(i)
            if seq.logprob_start is not None:
                # The hidden state at position p predicts the token at p + 1.
                first, stop = max(start, seq.logprob_start - 1), min(end, seq.num_prompt_tokens - 1)
                row0 = query_start[-2] - start
                lp_rows.extend(range(row0 + first, row0 + stop))
                lp_targets.extend(seq.token_ids[first + 1:stop + 1])
                lp_owners.extend([i] * max(0, stop - first))
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
        )
        return PreparedBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta, last_token_rows=last_rows, completing=completing,
            logprob_rows=lp_rows, logprob_targets=lp_targets, logprob_owners=lp_owners)

    @torch.inference_mode()
    def run(self, batch: Batch, staged: StagedStates) -> RunnerOutput:
        """One forward over `batch`. `staged`: the encoder rows' hidden states between their stages (its owner is
        the scheduler's): a row that runs its next stages takes its states out of it, a row with stages left puts
        its new ones back."""
        out = RunnerOutput.empty(len(batch))
        llm_rows = [i for i, s in enumerate(batch.seqs) if s.execution is RowExec.CAUSAL]
        # Encoder rows: pairs the scorer's own model runs (a cross-encoder), rows the embedder runs (any other)
        encoder_rows = [i for i, s in enumerate(batch.seqs) if s.execution is RowExec.ENCODER]
        own_rows = [i for i in encoder_rows if batch.seqs[i].kind is SeqKind.RERANK]
        embed_rows = [i for i in encoder_rows if batch.seqs[i].kind is not SeqKind.RERANK]
        clock = ForwardClock(self.device)
        if llm_rows:
            self._run_llm(batch, llm_rows, out, clock)
        pairs = ([batch.seqs[i] for i in own_rows], [batch.stages[i] for i in own_rows],
                 [_states_in(batch.seqs[i], batch.stages[i], staged) for i in own_rows])
        work = [StageWork(batch.seqs[i].token_ids, *batch.stages[i], batch.seqs[i].token_type_ids,
                          all_tokens=batch.seqs[i].params.all_tokens,
                          state=_states_in(batch.seqs[i], batch.stages[i], staged)) for i in embed_rows]
        own_scores: list[StageResult] = []
        # Rows of the other pooling tasks (a classifier's, a sparse embedder's) run on their own encoders, same step
        tasks = [batch.seqs[i].params.task for i in embed_rows]
        vectors: list[StageResult | None] = [None] * len(embed_rows)
        for task in dict.fromkeys(t for t in tasks if t is not PoolingTask.EMBED):
            js = [j for j, t in enumerate(tasks) if t is task]
            with clock:
                for j, result in zip(js, self.poolers[task].run_stages([work[j] for j in js])):
                    vectors[j] = result
        mine = [j for j, t in enumerate(tasks) if t is PoolingTask.EMBED]
        work = [work[j] for j in mine]
        done: list[StageResult] = []
        if own_rows and work and self.shared_encoder:  # one encoder: both kinds' rows in one forward
            with clock:
                own_scores, done = self.scorer.staged.run_parts(
                    [self.scorer.stage_part(*pairs), self.embedder.stage_part(work)])
        else:
            if own_rows:
                with clock:
                    own_scores = self.scorer.score_stages(*pairs)
            if work:
                with clock:
                    done = self.embedder.run_stages(work)
        for j, result in zip(mine, done):
            vectors[j] = result
        for i, result in zip(own_rows, own_scores):
            _keep_or_take(batch.seqs[i], result, staged, out.scores, i)  # a score, or the pair has stages left
        for i, result in zip(embed_rows, vectors):
            _keep_or_take(batch.seqs[i], result, staged, out.embeddings, i)  # a vector, or the row has stages left
        out.forward_s = clock.seconds()
        return out

    def _run_llm(self, batch: Batch, rows: list[int], out: RunnerOutput, clock: ForwardClock) -> None:
        """Fills `out` for the LLM rows; model forwards are timed on `clock`."""
        seqs = [batch.seqs[i] for i in rows]
        prepared = self.prepare(seqs, [batch.num_new_tokens[i] for i in rows])
        with clock:
            hidden = None
            if self.decode_graphs is not None:
                hidden = self.decode_graphs.run(prepared.input_ids, prepared.positions, prepared.meta)
            if hidden is None:
                hidden = self.model(prepared.input_ids, prepared.positions, self.kv_caches, prepared.meta)
            if prepared.logprob_rows:
                self._prompt_logprobs(hidden, prepared, seqs, rows, out.prompt_logprobs, out.prompt_top_logprobs)
        gen_rows, gen_seqs, pair_rows, pair_seqs = [], [], [], []
        for row, j in zip(prepared.last_token_rows, prepared.completing):
            if seqs[j].samples:
                gen_rows.append(row)
                gen_seqs.append(rows[j])
            else:
                pair_rows.append(row)
                pair_seqs.append(rows[j])
        if gen_rows:
            with clock:
                logits = self.model.compute_logits(hidden[gen_rows])
            drawn = sample_sequences(logits, [batch.seqs[i] for i in gen_seqs], self.eos_token_ids)
            for i, t, lp in zip(gen_seqs, drawn.tokens, drawn.logprobs):
                out.sampled[i] = t
                out.logprobs[i] = lp
        if pair_rows and self.scorer.scores_last_position:
            for i, s in zip(pair_seqs, self.scorer.score([batch.seqs[i] for i in pair_seqs], hidden[pair_rows])):
                out.scores[i] = s

    def _prompt_logprobs(self, hidden: torch.Tensor, prepared: PreparedBatch, seqs: list[Sequence],
                         batch_rows: list[int], spans: list, tops_out: list) -> None:
        """Per batch row (`batch_rows` maps the prepared sequences to it): the log-probabilities of the prompt tokens this
        chunk predicts into `spans`, and, for sequences that ask (num_prompt_logprobs), the top alternatives into
        `tops_out`. The LM head runs on those rows only, never on the whole batch."""
        values: list[float] = []
        tops: list[dict[int, float] | None] = []
        ks = [seqs[owner].num_prompt_logprobs for owner in prepared.logprob_owners]
        for lo in range(0, len(prepared.logprob_rows), self.LOGPROB_CHUNK):
            rows = prepared.logprob_rows[lo:lo + self.LOGPROB_CHUNK]
            chunk_targets = prepared.logprob_targets[lo:lo + self.LOGPROB_CHUNK]
            targets = torch.tensor(chunk_targets, device=hidden.device)
            logprobs = self.model.compute_logits(hidden[rows]).log_softmax(dim=-1)
            values.extend(logprobs.gather(1, targets[:, None])[:, 0].tolist())
            tops.extend(self._prompt_tops(logprobs, chunk_targets, ks[lo:lo + self.LOGPROB_CHUNK]))
        for owner, value, top in zip(prepared.logprob_owners, values, tops):
            row = batch_rows[owner]
            if spans[row] is None:
                spans[row] = []
            spans[row].append(value)
            if top is not None:
                if tops_out[row] is None:
                    tops_out[row] = []
                tops_out[row].append(top)

    @staticmethod
    def _prompt_tops(logprobs: torch.Tensor, targets: list[int], ks: list[int | None]) -> list[dict | None]:
        """Per row of a chunk: the prompt token and the top k alternatives, for rows whose sequence asks."""
        asking = [j for j, k in enumerate(ks) if k is not None]
        out: list[dict | None] = [None] * len(ks)
        if asking:
            index = asking if len(asking) < len(ks) else slice(None)
            found = top_logprobs(logprobs[index], [targets[j] for j in asking], [ks[j] for j in asking])
            for j, top in zip(asking, found):
                out[j] = top
        return out


class ForwardClock:
    """Sums the time of `with clock:` sections. On CUDA it records events, so it neither syncs nor counts only
    the launches; read seconds() after something has synced (the sampled tokens' .tolist() does)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __enter__(self) -> None:
        if self.cuda:
            self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self._events[-1][0].record()
        else:
            self._start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._events[-1][1].record()
        else:
            self._seconds += time.perf_counter() - self._start

    def seconds(self) -> float:
        for start, end in self._events:
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1000
        self._events.clear()
        return self._seconds


def _states_in(row: Sequence, stages: tuple[int, int], staged: StagedStates) -> torch.Tensor | None:
    """The hidden states an encoder row's stages this step start from (None at its first stage)."""
    return staged.take(row) if stages[0] > 0 else None


def _keep_or_take(row: Sequence, result: StageResult, staged: StagedStates, outputs: list, i: int) -> None:
    """A row whose last stage ran: its output into outputs[i]; one with stages left: its new states kept."""
    if result.done:
        outputs[i] = result.output
    else:
        staged.put(row, result.state)
