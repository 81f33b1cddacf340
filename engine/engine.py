"""LLMEngine: add requests, abort them, and step. step() is the only place compute happens."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from engine.admission import AdmissionPolicy
from engine.batch import Batch
from engine.builder import build_engine_parts
from engine.config import EmbedParams, EngineConfig, RerankParams, SamplingParams
from engine.embed import EmbedJob
from engine.intake import Generation, RequestIntake
from engine.detokenizer import TextStream
from engine.outputs import Logprobs, StepOutput, StepRecord
from engine.rerank import RerankJob
from engine.request import FinishReason, Sequence, SequenceStatus, SeqKind
from engine.runner import RunnerOutput

if TYPE_CHECKING:
    from engine.structured import GrammarCompiler

log = logging.getLogger("tandem.engine")

Request = Generation | RerankJob | EmbedJob


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, admission: AdmissionPolicy | None = None) -> None:
        """`admission`: how a step's leftover budget goes to prompts and scoring work (engine/admission.py); None:
        the policy the config names (tpot_target_ms, else rerank_share; engine/builder.py resolves it)."""
        self.config = config = config or EngineConfig()
        parts = build_engine_parts(config, admission)
        self.model_dir = parts.model_dir
        self.tokenizer = parts.tokenizer
        self.hf_config = parts.hf_config
        self.model_args = parts.model_args
        self.model = parts.model
        self.max_model_len = parts.max_model_len
        self.pool = parts.pool
        self.kv = parts.kv
        self.staged = parts.staged  # encoder rows' states between their stages (the scheduler frees them)
        self.admission = parts.admission
        self.scheduler = parts.scheduler
        self.scorer = parts.scorer
        self.runner = parts.runner
        self.embedder = parts.embedder
        self.eos_token_ids = parts.eos_token_ids
        self.quantization = parts.quantization
        self.weight_bytes, self.weight_format = parts.weight_bytes, parts.weight_format
        self.cpu_kernels = parts.cpu_kernels
        # Built on the first request with structured_outputs (engine/structured.py imports a grammar library).
        self.grammar_compiler: "GrammarCompiler | None" = None
        self.intake = RequestIntake(config, self.tokenizer, self.model_args.vocab_size, self.max_model_len,
                                    self.scheduler.budget, self.scorer, self._grammar_compiler,
                                    max_model_len_by=parts.max_model_len_by, embedder=parts.embedder)
        self._requests: dict[str, Request] = {}
        self._pending: list[StepOutput] = []  # final outputs of aborts, handed out with the next step
        self._observers: list[Callable[[StepRecord], None]] = []
        self._steps = 0

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, *, messages: list[dict] | None = None,
                    chat: bool = False) -> list[int]:
        """Queue a generation; returns its prompt token ids. Raises ValueError naming the field for bad input;
        nothing is queued then. `chat`: the prompt is token ids a chat template rendered (prompt_token_ids of
        messages), so it stops at the template's end-of-turn tokens as a request with `messages` does."""
        self._check_new_id(request_id)
        gen = self.intake.generation(request_id, prompt, params, messages, chat=chat)
        self._requests[request_id] = gen
        for seq in gen.seqs:
            self.scheduler.add(seq)
        return list(gen.seq.token_ids)

    def prepare_rerank(self, request_id: str, query: str, documents: list[str],
                       params: RerankParams | None = None) -> RerankJob:
        """Check and tokenize a rerank request into a job, without queueing it: reads the tokenizer and the rerank
        mode only, so another thread may call it while this one steps (the service tokenizes there). Raises
        ValueError naming the field."""
        return self.intake.rerank(request_id, query, documents, params)

    def add_rerank(self, request_id: str, query: str, documents: list[str],
                   params: RerankParams | None = None, *, prepared: RerankJob | None = None) -> None:
        """Queue a rerank job: one prefill-only pair per document, scored in the same steps as generation.
        `prepared`: the job prepare_rerank made of these arguments (else it is made here)."""
        self._check_new_id(request_id)
        job = prepared if prepared is not None else self.intake.rerank(request_id, query, documents, params)
        if job.request_id != request_id:
            raise ValueError(f"prepared job is {job.request_id!r}, not {request_id!r}")
        self._requests[request_id] = job
        for seq in job.sequences:
            self.scheduler.add(seq)

    def prepare_embed(self, request_id: str, inputs: list[str] | list[list[int]],
                      params: EmbedParams | None = None) -> EmbedJob:
        """Check and tokenize an embedding request into a job, without queueing it: reads the embedder's tokenizer
        only, so another thread may call it while this one steps (the service tokenizes there). Raises ValueError
        naming the field."""
        return self.intake.embed(request_id, inputs, params)

    def add_embed(self, request_id: str, inputs: list[str] | list[list[int]], params: EmbedParams | None = None,
                  *, prepared: EmbedJob | None = None) -> None:
        """Queue an embedding request: one prefill-only, KV-free row per input, run whole by the embedder in the
        same steps as generation and reranking (its own scoring queue, in one priority order with rerank pairs'). Its one output
        carries `embeddings`. `prepared`: the job prepare_embed made of these arguments (else it is made here)."""
        self._check_new_id(request_id)
        job = prepared if prepared is not None else self.intake.embed(request_id, inputs, params)
        if job.request_id != request_id:
            raise ValueError(f"prepared job is {job.request_id!r}, not {request_id!r}")
        self._requests[request_id] = job
        for row in job.rows:
            self.scheduler.add(row)

    def chat_token_ids(self, messages: list[dict]) -> list[int]:
        return self.intake.chat_token_ids(messages)

    def prompt_token_ids(self, prompt: str | list[int] | None, messages: list[dict] | None = None,
                         tools: list[dict] | None = None) -> list[int]:
        """A prompt's (or chat's, with the tools it may call) token ids, checked: reads the tokenizer only, so another
        thread may call it while this one steps (the service tokenizes there, then adds the ids). Raises ValueError
        naming the field."""
        return self.intake.prompt_token_ids(prompt, messages, tools)

    def _grammar_compiler(self) -> "GrammarCompiler":
        if self.grammar_compiler is None:
            from engine.structured import GrammarCompiler

            self.grammar_compiler = GrammarCompiler(self.tokenizer, self.model_args.vocab_size,
                                                    stop_token_ids=sorted(self.eos_token_ids))
        return self.grammar_compiler

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks are freed now, its final output comes with the next step."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        for seq in _seqs_of(req):
            if not seq.status.finished:
                self._let_go(seq, SequenceStatus.FINISHED_ABORTED)
        if isinstance(req, (RerankJob, EmbedJob)):
            self._pending.append(_final_output(req, FinishReason.ABORT))
        else:
            self._pending.extend(_abort_outputs(req))
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
            "staged_rows": len(self.staged),  # encoder rows part-way through their stages, and their states' bytes
            "staged_bytes": self.staged.num_bytes,
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
            "cpu_kernels": self.cpu_kernels,
            "reranker": str(self.config.reranker) if self.config.reranker else "llm",
            "rerank_mode": self.scorer.mode,
            # The most tokens one rerank pair may have (template, query and document), and what sets it.
            "rerank_max_pair_tokens": self.intake.rerank_limit()[0],
            "rerank_limit_by": self.intake.rerank_limit()[1],
            "vocab_size": self.model_args.vocab_size,  # what clients need for token ids and logit_bias
            **self._embedder_info(),
        }

    def _embedder_info(self) -> dict:
        e = self.embedder
        if e is None:
            return {"embedder": ""}
        return {"embedder": e.name, "embedder_architecture": e.architecture, "embedding_dimensions": e.dim,
                "embedder_pooling": str(e.pooling), "embedder_max_tokens": e.max_length,
                "embedder_matryoshka": e.matryoshka}

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        start = time.monotonic()
        batch = self.scheduler.schedule()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = start
        outputs, self._pending = self._pending, []
        predicted = self.admission.predict(batch) if batch.seqs else None
        forward_s = 0.0
        if batch.seqs:
            try:
                result = self.runner.run(batch, self.staged)
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
        """Apply one step's results, the one place that does: put the prompt (span) log-probabilities each row
        computed on its request, score the pairs whose last chunk ran, append each sampled token and decide there
        whether its sequence stops. Fills `finished` with the sequences the scheduler must let go; its update() then
        advances every row's computed tokens (num_computed_tokens is the scheduler's alone)."""
        outputs = []
        now = time.monotonic()
        requests = self._requests
        for seq, n, stages, token, score, lp, span, top, vector in zip(
                batch.seqs, batch.num_new_tokens, batch.stages, result.sampled, result.scores, result.logprobs,
                result.prompt_logprobs, result.prompt_top_logprobs, result.embeddings):
            if seq.kind is SeqKind.EMBED:
                if vector is None:
                    continue  # some of the row's stages ran: the rest come in later steps
                finished[seq] = SequenceStatus.FINISHED_STOPPED
                job = requests[seq.request_id]
                if isinstance(job, RerankJob):  # a fusing rerank's query or document
                    job.vectors[seq.index] = vector
                else:
                    job.vectors[seq.index] = self.embedder.finish(vector, job.params)
                job.remaining -= 1
                if not job.remaining:
                    self._ran_out(job, outputs)
                continue
            if seq.kind is SeqKind.RERANK:
                job = requests[seq.request_id]
                index = seq.pair.index
                if span:
                    _put_span(job.span_logprobs[index], seq, span)
                if not seq.ends_with(n, stages):
                    continue  # a chunk (or some stages) of a pair: scored when its last one runs
                finished[seq] = SequenceStatus.FINISHED_STOPPED
                job.scores[index] = self.scorer.pair_score(score, job.span_logprobs[index])
                job.remaining -= 1
                if not job.remaining:
                    self._ran_out(job, outputs)
                continue
            if seq.status is not SequenceStatus.RUNNING or seq in finished:
                continue  # its request failed earlier in this step
            gen = requests[seq.request_id]
            if span:
                _put_span(gen.prompt_logprobs, seq, span)
                if top:
                    _put_span(gen.prompt_top_logprobs, seq, top)
            if token is not None:
                outputs.append(self._append(gen, seq, token, lp, now, finished))
        return outputs

    def _ran_out(self, job: RerankJob | EmbedJob, outputs: list[StepOutput]) -> None:
        """Everything queued for `job` has run: queue its held pairs the scorer now chooses (the cascade's dense top
        k, once its embedder rows are in), or else end it."""
        if isinstance(job, RerankJob) and job.held:
            for seq in job.release(self.scorer.chosen(job.pooled_vectors())):
                self.scheduler.add(seq)
            return
        outputs.append(self._done(job))

    def _done(self, job: RerankJob | EmbedJob) -> StepOutput:
        """The final output of a rerank or embedding job whose last pair or row has run."""
        del self._requests[job.request_id]
        if isinstance(job, RerankJob):
            job.scores = self.scorer.request_scores(job.pooled_scores(), job.pooled_vectors() if job.rows else None)
        return _final_output(job, FinishReason.STOP)

    def _append(self, gen: Generation, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float,
                finished: dict[Sequence, SequenceStatus]) -> StepOutput:
        """One sampled token of one completion: its output, and the request's end when it was the last one."""
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if gen.first_token_time is None:
            gen.first_token_time = now
        stream = gen.streams[seq.index]
        out = _delta_output(gen, seq, token, stream.add(token))
        if seq.params.logprobs is not None:
            out.logprobs = [logprobs if logprobs is not None else {}]
        if not gen.sent_first:
            gen.sent_first = True
            out.prompt_logprobs = _prompt_logprobs(gen)
        if seq.grammar is not None and not seq.grammar.accept(token):
            return self._fail_request(gen, out, f"structured output: the grammar rejected token {token}", finished)
        status = self._stop_status(seq, token, stream)
        if status is None:
            return out
        finished[seq] = status
        out.text += stream.finish()
        out.finish_reason = status.finish_reason
        gen.finish_reasons[seq.index] = status.finish_reason
        gen.num_done += 1
        if gen.num_done == len(gen.seqs):
            del self._requests[gen.request_id]
            _close(out, gen)
        return out

    def _fail_request(self, gen: Generation, out: StepOutput, message: str,
                      finished: dict[Sequence, SequenceStatus]) -> StepOutput:
        """End every completion of `gen` with an error inside the step (the scheduler lets them go in update)."""
        log.error("request %s failed: %s", gen.request_id, message)
        for s in gen.seqs:
            if not s.status.finished:
                finished[s] = SequenceStatus.FINISHED_ERROR
        del self._requests[gen.request_id]
        out.finish_reason, out.error = FinishReason.ERROR, message
        _close(out, gen)
        return out

    def _stop_status(self, seq: Sequence, token: int, stream: TextStream) -> SequenceStatus | None:
        p = seq.params
        if seq.grammar is not None and seq.grammar.is_terminated():
            return SequenceStatus.FINISHED_STOPPED
        # The first min_tokens tokens never stop a sequence (the sampler masks EOS and stop_token_ids there).
        if seq.num_output_tokens > p.min_tokens and (
                (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids or stream.stopped):
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
                    self._let_go(s, SequenceStatus.FINISHED_ERROR)
            outputs.append(_final_output(req, FinishReason.ERROR, message))
        return outputs

    def _let_go(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence before it finished its work: the scheduler frees its blocks (an encoder row: its states
        between its stages)."""
        self.scheduler.finish(seq, status)

    def _emit_record(self, batch: Batch, start: float, forward_s: float, predicted_s: float | None) -> None:
        policy = self.admission
        if not self._observers and not policy.observes_steps:
            return
        record = StepRecord(
            step=self._steps, start_time=start, duration_s=time.monotonic() - start,
            decode_tokens=batch.num_decode_tokens, prefill_tokens=batch.num_prefill_tokens,
            cached_tokens=batch.num_cached_tokens, rerank_pairs=batch.num_rerank_pairs,
            rerank_tokens=batch.num_rerank_tokens, num_seqs=len(batch), budget=batch.budget or self.scheduler.budget,
            kv_blocks_total=self.pool.num_blocks, kv_blocks_free=self.pool.num_free,
            kv_blocks_cached=self.pool.num_cached, preempted=len(batch.preempted),
            num_running=len(self.scheduler.running), num_waiting=self.scheduler.num_waiting,
            request_ids=list(dict.fromkeys(s.request_id for s in batch.seqs)),
            decode_request_ids=batch.decode_request_ids, forward_s=forward_s,
            decode_context_tokens=batch.num_decode_context_tokens, cross_encoder_tokens=batch.num_cross_encoder_tokens,
            rerank_pairs_scored=batch.num_rerank_pairs_scored, predicted_s=predicted_s, target_s=batch.target_s,
            limit_s=batch.limit_s, planned=batch.planned,
            embed_rows=batch.num_embed_rows, embed_tokens=batch.num_embed_tokens,
            embed_rows_done=batch.num_embed_rows_done,
            cpu_kernels=self.cpu_kernels)
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
    return req.sequences if isinstance(req, RerankJob) else req.rows if isinstance(req, EmbedJob) else req.seqs


def _delta_output(gen: Generation, seq: Sequence, token: int, text: str) -> StepOutput:
    """Usage is the request's: the prompt once (completion 0's cached tokens), completion tokens summed over n."""
    first = gen.seq
    return StepOutput(request_id=seq.request_id, kind=SeqKind.GENERATE, new_token_ids=[token], text=text,
                      index=seq.index, completion_tokens=gen.completion_tokens, prompt_tokens=first.num_prompt_tokens,
                      cached_tokens=first.num_cached_tokens, first_token_time=gen.first_token_time,
                      arrival_time=first.arrival_time)


def _close(out: StepOutput, gen: Generation) -> None:
    """Make `out` the request's last output."""
    out.finished = True
    out.completion_tokens = gen.completion_tokens
    out.queue_time_s = _queue_time(gen.seq)


def _queue_time(seq: Sequence) -> float | None:
    return seq.first_scheduled_time - seq.arrival_time if seq.first_scheduled_time is not None else None


def _put_span(acc: list, seq: Sequence, span: list) -> None:
    """Put the log-probabilities (or top alternatives) a row's chunk computed for positions logprob_start.. in their
    place in `acc`, the request's: a chunk that starts over (a preempted sequence recomputing) replaces the rest."""
    first = seq.logprob_start - 1  # the position whose hidden state predicts the first scored token
    acc[max(seq.num_computed_tokens - first, 0):] = span


def _prompt_logprobs(gen: Generation) -> list[Logprobs | None] | None:
    """One entry per prompt token: None for the first, then the prompt token's raw log-probability followed by the
    top alternatives the runner found (the prompt token is there even when it is not among them)."""
    seq = gen.seq
    if seq.num_prompt_logprobs is None:
        return None
    tops = gen.prompt_top_logprobs
    out: list[Logprobs | None] = [None]
    for j, value in enumerate(gen.prompt_logprobs):
        token = seq.token_ids[j + 1]
        top = tops[j] if j < len(tops) else {}
        out.append({token: value, **{t: v for t, v in top.items() if t != token}})
    return out


def _abort_outputs(gen: Generation) -> list[StepOutput]:
    """One output per completion still running, finish reason "abort"; the last one ends the request."""
    outs = []
    for seq, stream, reason in zip(gen.seqs, gen.streams, gen.finish_reasons):
        if reason is not None:
            continue
        outs.append(StepOutput(request_id=gen.request_id, kind=SeqKind.GENERATE, text=stream.finish(),
                               finish_reason=FinishReason.ABORT, index=seq.index,
                               prompt_tokens=gen.seq.num_prompt_tokens,
                               cached_tokens=gen.seq.num_cached_tokens, completion_tokens=gen.completion_tokens,
                               first_token_time=gen.first_token_time, arrival_time=gen.seq.arrival_time))
    _close(outs[-1], gen)
    return outs


def _final_output(req: Request, reason: FinishReason, error: str | None = None) -> StepOutput:
    if isinstance(req, EmbedJob):
        started = [r.first_scheduled_time for r in req.rows if r.first_scheduled_time is not None]
        done = reason is FinishReason.STOP
        return StepOutput(request_id=req.request_id, kind=SeqKind.EMBED, finished=True, finish_reason=reason,
                          error=error, embeddings=list(req.vectors) if done else None,
                          truncated=list(req.truncated) if done else None, prompt_tokens=req.prompt_tokens,
                          arrival_time=req.arrival_time,
                          queue_time_s=min(started) - req.arrival_time if started else None)
    if isinstance(req, RerankJob):
        started = [p.first_scheduled_time for p in req.sequences if p.first_scheduled_time is not None]
        return StepOutput(request_id=req.request_id, kind=SeqKind.RERANK, finished=True, finish_reason=reason,
                          error=error, scores=list(req.scores) if reason is FinishReason.STOP else None,
                          document_tokens=list(req.document_tokens) if reason is FinishReason.STOP else None,
                          truncated=list(req.truncated) if reason is FinishReason.STOP else None,
                          windows=list(req.windows) if reason is FinishReason.STOP else None,
                          prompt_tokens=req.prompt_tokens, cached_tokens=req.cached_tokens,
                          arrival_time=req.arrival_time,
                          queue_time_s=min(started) - req.arrival_time if started else None)
    seq = req.seq
    return StepOutput(request_id=req.request_id, kind=SeqKind.GENERATE, text=req.streams[0].finish(),
                      finished=True, finish_reason=reason, error=error,
                      prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens,
                      completion_tokens=req.completion_tokens, first_token_time=req.first_token_time,
                      arrival_time=seq.arrival_time, queue_time_s=_queue_time(seq))
