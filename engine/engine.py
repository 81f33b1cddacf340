"""LLMEngine: add requests, abort them, and step. step() is the only place compute happens."""
from __future__ import annotations

import logging
import time
from typing import Callable

from engine.batch import Batch
from engine.builder import build_engine_parts
from engine.config import EngineConfig, RerankParams, SamplingParams
from engine.intake import Generation, RequestIntake
from engine.outputs import StepOutput, StepRecord
from engine.rerank import RerankJob
from engine.request import Sequence, SequenceStatus, SeqKind
from engine.runner import RunnerOutput

log = logging.getLogger("tandem.engine")

Request = Generation | RerankJob


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        parts = build_engine_parts(config)
        self.model_dir = parts.model_dir
        self.tokenizer = parts.tokenizer
        self.hf_config = parts.hf_config
        self.model_args = parts.model_args
        self.model = parts.model
        self.max_model_len = parts.max_model_len
        self.pool = parts.pool
        self.kv = parts.kv
        self.scheduler = parts.scheduler
        self.scorer = parts.scorer
        self.runner = parts.runner
        self.eos_token_ids = parts.eos_token_ids
        self.quantization = parts.quantization
        self.weight_bytes, self.weight_format = parts.weight_bytes, parts.weight_format
        self.intake = RequestIntake(config, self.tokenizer, self.model_args.vocab_size, self.max_model_len,
                                    self.scheduler.budget, self.scorer)
        self._requests: dict[str, Request] = {}
        self._pending: list[StepOutput] = []  # final outputs of aborts, handed out with the next step
        self._observers: list[Callable[[StepRecord], None]] = []
        self._steps = 0

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, *, messages: list[dict] | None = None) -> list[int]:
        """Queue a generation; returns its prompt token ids. Raises ValueError naming the field for bad input;
        nothing is queued then."""
        self._check_new_id(request_id)
        gen = self.intake.generation(request_id, prompt, params, messages)
        self._requests[request_id] = gen
        self.scheduler.add(gen.seq)
        return list(gen.seq.token_ids)

    def add_rerank(self, request_id: str, query: str, documents: list[str],
                   params: RerankParams | None = None) -> None:
        """Queue a rerank job: one prefill-only pair per document, scored in the same steps as generation."""
        self._check_new_id(request_id)
        job = self.intake.rerank(request_id, query, documents, params)
        self._requests[request_id] = job
        for pair in job.pairs:
            self.scheduler.add(pair)

    def chat_token_ids(self, messages: list[dict]) -> list[int]:
        return self.intake.chat_token_ids(messages)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks are freed now, its final output comes with the next step."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        for seq in _seqs_of(req):
            if not seq.status.finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._pending.append(_final_output(req, "abort"))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    @property
    def request_ids(self) -> set[str]:
        """Ids of the live requests (an aborted one leaves at once; its final output follows)."""
        return set(self._requests)

    def add_observer(self, fn: Callable[[StepRecord], None]) -> None:
        self._observers.append(fn)

    def remove_observer(self, fn: Callable[[StepRecord], None]) -> None:
        self._observers.remove(fn)

    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_free": self.pool.num_free,
            "kv_blocks_cached": self.pool.num_cached,
            "block_size": self.config.block_size,
            "num_running": len(self.scheduler.running),
            "num_waiting": self.scheduler.num_waiting,
            "num_requests": len(self._requests),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self._steps,
            "weight_bytes": self.weight_bytes,
        }

    def model_info(self) -> dict:
        return {
            "model": str(self.config.model or "SmolLM2-135M-Instruct (embedded)"),
            "model_dir": str(self.model_dir),
            "architecture": (self.hf_config.get("architectures") or ["LlamaForCausalLM"])[0],
            "max_model_len": self.max_model_len,
            "block_size": self.config.block_size,
            "kv_blocks_total": self.pool.num_blocks,
            "device": self.config.device,
            "dtype": self.config.dtype,
            "quantization": self.quantization,
            "weight_format": self.weight_format,
            "weight_bytes": self.weight_bytes,
            "reranker": str(self.config.reranker) if self.config.reranker else "llm",
            "rerank_mode": self.scorer.mode,
        }

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        start = time.monotonic()
        batch = self.scheduler.schedule()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = start
        outputs, self._pending = self._pending, []
        predicted = self.scheduler.policy.predict(batch) if batch.seqs else None
        forward_s = 0.0
        if batch.seqs:
            try:
                result = self.runner.run(batch)
            except Exception as exc:  # one bad step fails its own requests, not the engine
                log.exception("model step failed")
                outputs.extend(self._fail_batch(batch, f"model step failed: {exc!r}"))
            else:
                forward_s = result.forward_s
                finished: dict[Sequence, SequenceStatus] = {}
                outputs.extend(self._process(batch, result, finished))
                self.scheduler.update(batch, finished)
        self._steps += 1
        self._emit_record(batch, start, forward_s, predicted)
        return outputs

    def _process(self, batch: Batch, result: RunnerOutput, finished: dict[Sequence, SequenceStatus]
                 ) -> list[StepOutput]:
        """Append each sampled token and decide there whether its sequence stops; record scores. Fills `finished`
        with the sequences the scheduler must let go."""
        outputs = []
        now = time.monotonic()
        for seq, token, score in zip(batch.seqs, result.sampled, result.scores):
            if score is not None:
                finished[seq] = SequenceStatus.FINISHED_STOPPED
                job = seq.pair.job
                job.scores[seq.pair.index] = score
                job.remaining -= 1
                if not job.remaining:
                    del self._requests[job.request_id]
                    outputs.append(_final_output(job, "stop"))
                continue
            if token is None or seq.status is not SequenceStatus.RUNNING:
                continue
            gen = self._requests[seq.request_id]
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            text = gen.stream.add(token)
            status = self._stop_status(seq, token, gen)
            if status is None:
                outputs.append(_delta_output(seq, token, text))
                continue
            finished[seq] = status
            del self._requests[seq.request_id]
            out = _final_output(gen, status.finish_reason)
            out.new_token_ids = [token]
            out.text = text + out.text
            outputs.append(out)
        return outputs

    def _stop_status(self, seq: Sequence, token: int, gen: Generation) -> SequenceStatus | None:
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids or gen.stream.stopped:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _fail_batch(self, batch: Batch, message: str) -> list[StepOutput]:
        outputs = []
        for seq in batch.seqs:
            req = self._requests.pop(seq.request_id, None)
            if req is None:
                continue
            for s in _seqs_of(req):
                if not s.status.finished:
                    self.scheduler.finish(s, SequenceStatus.FINISHED_ERROR)
            outputs.append(_final_output(req, "error", message))
        return outputs

    def _emit_record(self, batch: Batch, start: float, forward_s: float, predicted_s: float | None) -> None:
        policy = self.scheduler.policy
        if not self._observers and not policy.observes_steps:
            return
        record = StepRecord(
            step=self._steps, start_time=start, duration_s=time.monotonic() - start,
            decode_tokens=batch.num_decode_tokens, prefill_tokens=batch.num_prefill_tokens,
            cached_tokens=batch.num_cached_tokens, rerank_pairs=batch.num_rerank_pairs,
            rerank_tokens=batch.num_rerank_tokens, num_seqs=len(batch), budget=self.scheduler.budget,
            kv_blocks_total=self.pool.num_blocks, kv_blocks_free=self.pool.num_free,
            kv_blocks_cached=self.pool.num_cached, preempted=len(batch.preempted),
            num_running=len(self.scheduler.running), num_waiting=self.scheduler.num_waiting,
            request_ids=list(dict.fromkeys(s.request_id for s in batch.seqs)),
            decode_request_ids=batch.decode_request_ids, forward_s=forward_s,
            decode_context_tokens=batch.num_decode_context_tokens, cross_encoder_tokens=batch.num_cross_encoder_tokens,
            predicted_s=predicted_s, target_s=policy.target_s)
        if policy.observes_steps:
            policy.observe(record)  # the step-time model learns from every step
        for fn in self._observers:
            fn(record)

    def _check_new_id(self, request_id: str) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")


# ---- outputs: built here and nowhere else ----------------------------------------------------------------

def _seqs_of(req: Request) -> list[Sequence]:
    return req.pairs if isinstance(req, RerankJob) else [req.seq]


def _delta_output(seq: Sequence, token: int, text: str) -> StepOutput:
    return StepOutput(request_id=seq.request_id, kind=SeqKind.GENERATE, new_token_ids=[token], text=text,
                      completion_tokens=seq.num_output_tokens, prompt_tokens=seq.num_prompt_tokens,
                      cached_tokens=seq.num_cached_tokens, first_token_time=seq.first_token_time,
                      arrival_time=seq.arrival_time)


def _final_output(req: Request, reason: str, error: str | None = None) -> StepOutput:
    if isinstance(req, RerankJob):
        started = [p.first_scheduled_time for p in req.pairs if p.first_scheduled_time is not None]
        return StepOutput(request_id=req.request_id, kind=SeqKind.RERANK, finished=True, finish_reason=reason,
                          error=error, scores=list(req.scores) if reason == "stop" else None,
                          prompt_tokens=req.prompt_tokens, cached_tokens=req.cached_tokens,
                          arrival_time=req.arrival_time,
                          queue_time_s=min(started) - req.arrival_time if started else None)
    seq = req.seq
    return StepOutput(request_id=req.request_id, kind=SeqKind.GENERATE, text=req.stream.finish(),
                      finished=True, finish_reason=reason, error=error,
                      prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens,
                      completion_tokens=seq.num_output_tokens, first_token_time=seq.first_token_time,
                      arrival_time=seq.arrival_time,
                      queue_time_s=(seq.first_scheduled_time - seq.arrival_time
                                    if seq.first_scheduled_time is not None else None))
