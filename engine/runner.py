"""Turns a scheduled Batch into flat tensors, runs one forward over the ragged batch, samples."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import Capture, DecodeGraphs, try_capture
from engine.models.llama import LlamaForCausalLM
from engine.request import Sequence, SeqKind
from engine.sampling import sample
from engine.scheduler import Batch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class RunnerOutput:
    sampled: list[int | None]  # per batch sequence: its next token, if its prompt completed this step
    scores: list[float | None]  # per batch sequence: the rerank score, for rerank pairs
    forward_s: float = 0.0  # time inside model forwards (LLM and cross-encoder), the rest is engine overhead


@dataclass(slots=True)
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    last_token_rows: list[int]  # flat index of the last token of each sequence that completes
    completing: list[int]  # batch positions of those sequences


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: str, dtype: str,
                 judge_token_ids: tuple[int, int] | None = None) -> None:
        a = model.args
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_caches = torch.zeros(
            (a.num_layers, 2, num_blocks, block_size, a.num_kv_heads, a.head_dim),
            dtype=DTYPES[dtype], device=self.device)
        self.judge_token_ids = judge_token_ids  # ("yes", "no") ids for LLM-as-reranker scores
        self.cross_encoder = None  # set when the engine serves a cross-encoder reranker
        self.decode_graphs: DecodeGraphs | None = None  # set by capture_decode_graphs

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
            meta=meta, last_token_rows=last_rows, completing=completing)

    @torch.inference_mode()
    def run(self, batch: Batch) -> RunnerOutput:
        sampled: list[int | None] = [None] * len(batch)
        scores: list[float | None] = [None] * len(batch)
        llm_rows = [i for i, s in enumerate(batch.seqs) if s.uses_kv]
        encoder_rows = [i for i, s in enumerate(batch.seqs) if not s.uses_kv]
        clock = ForwardClock(self.device)
        if llm_rows:
            self._run_llm(batch, llm_rows, sampled, scores, clock)
        if encoder_rows:
            pairs = [(batch.seqs[i].token_ids, batch.seqs[i].token_type_ids) for i in encoder_rows]
            with clock:
                encoder_scores = self.cross_encoder.score(pairs)
            for i, score in zip(encoder_rows, encoder_scores):
                scores[i] = score
        return RunnerOutput(sampled=sampled, scores=scores, forward_s=clock.seconds())

    def _run_llm(self, batch: Batch, rows: list[int], sampled: list, scores: list, clock: ForwardClock) -> None:
        """Fills `sampled` and `scores` for the LLM rows; model forwards are timed on `clock`."""
        seqs = [batch.seqs[i] for i in rows]
        prepared = self.prepare(seqs, [batch.num_new_tokens[i] for i in rows])
        with clock:
            hidden = None
            if self.decode_graphs is not None:
                hidden = self.decode_graphs.run(prepared.input_ids, prepared.positions, prepared.meta)
            if hidden is None:
                hidden = self.model(prepared.input_ids, prepared.positions, self.kv_caches, prepared.meta)
        gen_rows, gen_seqs, judge_rows, judge_seqs = [], [], [], []
        for row, j in zip(prepared.last_token_rows, prepared.completing):
            if seqs[j].kind is SeqKind.RERANK:
                judge_rows.append(row)
                judge_seqs.append(rows[j])
            else:
                gen_rows.append(row)
                gen_seqs.append(rows[j])
        if gen_rows:
            with clock:
                logits = self.model.compute_logits(hidden[gen_rows])
            chosen = [batch.seqs[i] for i in gen_seqs]
            tokens = sample(logits, [s.params for s in chosen], [s.generator for s in chosen])
            for i, t in zip(gen_seqs, tokens):
                sampled[i] = t
        if judge_rows:
            for i, s in zip(judge_seqs, self.judge_scores(hidden[judge_rows])):
                scores[i] = s

    def judge_scores(self, hidden: torch.Tensor) -> list[float]:
        """P(yes) / (P(yes) + P(no)) from the last position, using only the two lm_head rows needed."""
        if self.judge_token_ids is None:
            raise RuntimeError("no judge tokens configured for LLM reranking")
        weight = self.model.lm_head_rows(list(self.judge_token_ids))  # [2, hidden]
        logits = (hidden @ weight.T).float()
        return logits.softmax(dim=-1)[:, 0].tolist()


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
