"""Turns a scheduled Batch into flat tensors, runs one forward over the ragged batch, samples."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
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
        forward_s = 0.0
        if llm_rows:
            forward_s += self._run_llm(batch, llm_rows, sampled, scores)
        if encoder_rows:
            pairs = [(batch.seqs[i].token_ids, batch.seqs[i].token_type_ids) for i in encoder_rows]
            start = time.perf_counter()
            encoder_scores = self.cross_encoder.score(pairs)
            forward_s += time.perf_counter() - start
            for i, score in zip(encoder_rows, encoder_scores):
                scores[i] = score
        return RunnerOutput(sampled=sampled, scores=scores, forward_s=forward_s)

    def _run_llm(self, batch: Batch, rows: list[int], sampled: list, scores: list) -> float:
        """Fills `sampled` and `scores` for the LLM rows; returns the seconds spent in the model forward."""
        seqs = [batch.seqs[i] for i in rows]
        prepared = self.prepare(seqs, [batch.num_new_tokens[i] for i in rows])
        start = time.perf_counter()
        hidden = self.model(prepared.input_ids, prepared.positions, self.kv_caches, prepared.meta)
        forward_s = time.perf_counter() - start
        gen_rows, gen_seqs, judge_rows, judge_seqs = [], [], [], []
        for row, j in zip(prepared.last_token_rows, prepared.completing):
            if seqs[j].kind is SeqKind.RERANK:
                judge_rows.append(row)
                judge_seqs.append(rows[j])
            else:
                gen_rows.append(row)
                gen_seqs.append(rows[j])
        if gen_rows:
            start = time.perf_counter()
            logits = self.model.compute_logits(hidden[gen_rows])
            forward_s += time.perf_counter() - start
            chosen = [batch.seqs[i] for i in gen_seqs]
            tokens = sample(logits, [s.params for s in chosen], [s.generator for s in chosen])
            for i, t in zip(gen_seqs, tokens):
                sampled[i] = t
        if judge_rows:
            for i, s in zip(judge_seqs, self.judge_scores(hidden[judge_rows])):
                scores[i] = s
        return forward_s

    def judge_scores(self, hidden: torch.Tensor) -> list[float]:
        """P(yes) / (P(yes) + P(no)) from the last position, using only the two lm_head rows needed."""
        if self.judge_token_ids is None:
            raise RuntimeError("no judge tokens configured for LLM reranking")
        weight = self.model.lm_head.weight[list(self.judge_token_ids)]  # [2, hidden]
        logits = (hidden @ weight.T).float()
        return logits.softmax(dim=-1)[:, 0].tolist()
