"""LLMEngine: prepare a request of any kind into its job (any thread), add it, abort it, and step. step() is the only
place compute happens."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from engine.admission import AdmissionPolicy
from engine.batch import Batch
from engine.builder import build_engine_parts
from engine.config import EmbedParams, EngineConfig, PoolingTask, RerankMode, RerankParams, SamplingParams
from engine.embed import EmbedJob
from engine.embed.tasks import model_info as pooling_info
from engine.intake import RequestIntake
from engine.kinds import build_job
from engine.rerank.intake import rerank_limit
from engine.jobs import Job, JobContext, RowResult, StepEffects
from engine.step_time import OnlineStepTime, StepShape
from engine.outputs import StepOutput, StepRecord
from engine.rerank import RerankJob
from engine.request import FinishReason, Sequence, SequenceStatus
from engine.runner import RunnerOutput
from engine.specs import EmbedSpec, GenerateSpec, JobSpec, RerankSpec

if TYPE_CHECKING:
    from engine.embed.embedder import Embedder
    from engine.structured import GrammarCompiler

EMBEDDED_LLM = "SmolLM2-135M-Instruct (embedded)"  # how model_info() names the embedded model (service/core.py)
log = logging.getLogger("tandem.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, admission: AdmissionPolicy | None = None) -> None:
        """`admission`: how a step's leftover budget goes to prompts and scoring work (engine/admission.py); None:
        the policy the config names (tpot_target_ms, else scoring_share; engine/builder.py resolves it)."""
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
        self.eos_token_ids = parts.eos_token_ids
        self.quantization = parts.quantization
        self.weight_bytes, self.weight_format = parts.weight_bytes, parts.weight_format
        self.cpu_kernels = parts.cpu_kernels
        self.narrow_rows = parts.narrow_rows  # the width past which a step's matmuls go wide (the loaded model's)
        # Built on the first request with structured_outputs (engine/structured.py imports a grammar library).
        self.grammar_compiler: "GrammarCompiler | None" = None
        self.intake = RequestIntake(config, self.tokenizer, self.model_args.vocab_size, self.max_model_len,
                                    self.scheduler.budget, self.scorer, self._grammar_compiler,
                                    max_model_len_by=parts.max_model_len_by, poolers=parts.poolers)
        self.poolers = parts.poolers  # every pooling encoder, by task (the embedder's EMBED, a classifier, ...)
        self.job_context = JobContext(self.scorer, self.eos_token_ids, self.max_model_len, parts.poolers)
        self._requests: dict[str, Job] = {}
        self._pending: list[StepOutput] = []  # final outputs of aborts, handed out with the next step
        self._observers: list[Callable[[StepRecord], None]] = []
        self._steps = 0

    # ---- requests ------------------------------------------------------------------------------

    def prepare(self, spec: JobSpec) -> Job:
        """Check and tokenize a request of any kind (engine/specs.py) into its job, without queueing it: reads the
        tokenizers and the engine's fixed parts only, so another thread may call it while this one steps (the
        service's intake thread does; a grammar is compiled there too). Raises ValueError naming the field (NotLoaded
        where a model is missing), TypeError for a spec the intake has no builder for."""
        return build_job(self.intake, spec)

    def add(self, job: Job) -> None:
        """Queue a prepared job: its rows join the scheduler's queues, served from the next step. Raises ValueError
        when its request_id is empty or in use by a live request; nothing is queued then."""
        self._check_new_id(job.request_id)
        self._queue(job)

    def _add_spec(self, spec: JobSpec) -> Job:
        """prepare() and add(), the id checked first: nothing is tokenized for a request that could not be queued."""
        self._check_new_id(spec.request_id)
        job = self.prepare(spec)
        self.add(job)
        return job

    # The per-kind calls (the public API in docs/architecture.md, the offline LLM, tests): each one spec through
    # prepare() and add().

    def add_request(self, request_id: str, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, *, messages: list[dict] | None = None,
                    chat: bool = False) -> list[int]:
        """Queue a generation; returns its prompt token ids. Raises ValueError naming the field for bad input;
        nothing is queued then. `chat`: the prompt is token ids a chat template rendered (prompt_token_ids of
        messages), so it stops at the template's end-of-turn tokens as a request with `messages` does."""
        job = self._add_spec(GenerateSpec(request_id, prompt, params, messages=messages, chat=chat))
        return list(job.sequences[0].token_ids)

    def prepare_rerank(self, request_id: str, query: str, documents: list[str],
                       params: RerankParams | None = None) -> RerankJob:
        """prepare() of a RerankSpec: the checked, tokenized job, not queued (any thread may call it)."""
        return self.prepare(RerankSpec(request_id, query, documents, params))

    def add_rerank(self, request_id: str, query: str, documents: list[str],
                   params: RerankParams | None = None) -> None:
        """Queue a rerank job: one prefill-only pair per document, scored in the same steps as generation."""
        self._add_spec(RerankSpec(request_id, query, documents, params))

    def prepare_embed(self, request_id: str, inputs: list[str] | list[list[int]],
                      params: EmbedParams | None = None) -> EmbedJob:
        """prepare() of an EmbedSpec: the checked, tokenized job, not queued (any thread may call it)."""
        return self.prepare(EmbedSpec(request_id, inputs, params))

    def add_embed(self, request_id: str, inputs: list[str] | list[list[int]],
                  params: EmbedParams | None = None) -> None:
        """Queue an embedding request: one prefill-only, KV-free row per input, run whole by the embedder in the
        same steps as generation and reranking (its own scoring queue, in one priority order with rerank pairs').
        Its one output carries `embeddings`."""
        self._add_spec(EmbedSpec(request_id, inputs, params))

    @property
    def embedder(self) -> "Embedder | None":
        """The embedding model (poolers[PoolingTask.EMBED]); None: not loaded."""
        return self.poolers.get(PoolingTask.EMBED)

    def _queue(self, job: Job) -> None:
        self._requests[job.request_id] = job
        rows = job.sequences
        deadline = self.admission.deadline(StepShape.of_rows(rows), rows[0].arrival_time) if rows else None
        for seq in rows:
            self.scheduler.add(seq, deadline)

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
        for seq in req.sequences:
            if not seq.status.finished:
                self._let_go(seq, SequenceStatus.FINISHED_ABORTED)
        self._pending.extend(req.final_outputs(FinishReason.ABORT))
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
            # per kind of work: (steps in the step-time model's window that carried it, the fit's median relative
            # error on them); empty without an online step-time model
            "step_time_fit_errors": _fit_errors(self.admission),
        }

    def model_info(self) -> dict:
        return {
            "model": str(self.config.model or EMBEDDED_LLM),
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
            **self._rerank_info(),
            # The most tokens one rerank pair may have (template, query and document), and what sets it.
            "rerank_max_pair_tokens": rerank_limit(self.intake)[0],
            "rerank_limit_by": rerank_limit(self.intake)[1],
            "vocab_size": self.model_args.vocab_size,  # what clients need for token ids and logit_bias
            **self._embedder_info(),
            **self._pooler_info(),
        }

    def _pooler_info(self) -> dict:
        """The classifier's and the sparse embedder's ids ("": not loaded), limits and the classifier's labels."""
        return pooling_info(self.poolers)

    def _embedder_info(self) -> dict:
        e = self.embedder
        if e is None:
            return {"embedder": ""}
        return {"embedder": e.name, "embedder_architecture": e.architecture, "embedding_dimensions": e.dim,
                "embedder_pooling": str(e.pooling), "embedder_max_tokens": e.max_length,
                "embedder_matryoshka": e.matryoshka, "embedder_dtype": e.dtype}

    def _rerank_info(self) -> dict:
        """What scores a rerank, as it runs: the mode, the model(s) it runs (`reranker`: the cross-encoder's path, the
        embedder's id for dense, the LLM for likelihood and judge, "embedder + LLM" for fusion and cascade) and the
        dtype(s) their forwards run in (`rerank_dtype`: an encoder's as --encoder-dtype resolved on this CPU)."""
        mode = RerankMode(self.scorer.mode)
        llm = (str(self.config.model or EMBEDDED_LLM), self.config.dtype)
        e = self.embedder
        embedder = (e.name, e.dtype) if e is not None else ("", "")
        used = {RerankMode.DENSE: [embedder], RerankMode.FUSION: [embedder, llm], RerankMode.CASCADE: [embedder, llm],
                RerankMode.CROSS_ENCODER: [(str(self.config.reranker), getattr(getattr(self.scorer, "encoder", None),
                                                                           "dtype", self.config.dtype))]
                }.get(mode, [llm])
        return {"rerank_mode": mode.value, "reranker": " + ".join(name for name, _ in used),
                "rerank_dtype": " + ".join(dict.fromkeys(dtype for _, dtype in used))}

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        start = time.monotonic()
        batch = self.scheduler.schedule(start)
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
        """Apply one step's results, the one place that does: each row's result goes to its job (Job.apply), which
        accumulates it (a sampled token, a pair's score, a vector) and says what it hands out, which rows end and
        which it queues. Fills `finished` with the rows the scheduler must let go; its update() then advances every
        row's computed tokens (num_computed_tokens is the scheduler's alone)."""
        effects = StepEffects(time.monotonic(), finished=finished)
        for seq, n, stages, token, score, lp, span, top, vector in zip(
                batch.seqs, batch.num_new_tokens, batch.stages, result.sampled, result.scores, result.logprobs,
                result.prompt_logprobs, result.prompt_top_logprobs, result.embeddings):
            if seq.status is not SequenceStatus.RUNNING or seq in finished:
                continue  # its request failed earlier in this step
            job = self._requests[seq.request_id]
            job.apply(seq, RowResult(n, stages, token, lp, score, span, top, vector), effects, self.job_context)
            if job.finished:
                del self._requests[job.request_id]
        for seq in effects.queued:
            self.scheduler.add(seq)
        return effects.outputs

    def _fail_batch(self, batch: Batch, message: str) -> list[StepOutput]:
        outputs = []
        for seq in batch.seqs:
            req = self._requests.pop(seq.request_id, None)
            if req is None:
                continue
            for s in req.sequences:
                if not s.status.finished:
                    self._let_go(s, SequenceStatus.FINISHED_ERROR)
            outputs.extend(req.final_outputs(FinishReason.ERROR, message))
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
            decode_tokens=batch.num_decode_tokens, cached_tokens=batch.num_cached_tokens,
            tokens=batch.tokens, rows=batch.rows, rows_done=batch.rows_done,
            num_seqs=len(batch), budget=batch.budget or self.scheduler.budget,
            kv_blocks_total=self.pool.num_blocks, kv_blocks_free=self.pool.num_free,
            kv_blocks_cached=self.pool.num_cached, preempted=len(batch.preempted),
            num_running=len(self.scheduler.running), num_waiting=self.scheduler.num_waiting,
            request_ids=list(dict.fromkeys(s.request_id for s in batch.seqs)),
            decode_request_ids=batch.decode_request_ids, forward_s=forward_s,
            decode_context_tokens=batch.num_decode_context_tokens, predicted_s=predicted_s, target_s=batch.target_s,
            limit_s=batch.limit_s, planned=batch.planned, owed=batch.owed, cpu_kernels=self.cpu_kernels)
        if policy.observes_steps:
            policy.observe(record)  # the step-time model learns from every step
        for fn in self._observers:
            fn(record)

    def _check_new_id(self, request_id: str) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")


def _fit_errors(policy) -> dict[str, tuple[int, float]]:
    """The admission policy's online step-time model's error per kind of work (OnlineStepTime.fit_errors), or {}."""
    model = getattr(policy, "model", None)
    return model.fit_errors() if isinstance(model, OnlineStepTime) else {}

