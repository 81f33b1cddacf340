"""LLMEngine: add requests, abort them, and step. step() is the only place compute happens."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

import kernels

from engine.config import EngineConfig, RerankParams, SamplingParams
from engine.cuda_graphs import capture_sizes, cuda_graph_capture
from engine.detokenizer import TextStream
from engine.kv_cache import BlockPool, KVCacheManager
from engine.models.llama import LlamaArgs, LlamaForCausalLM
from engine.models.loader import load_state_dict, read_config, resolve_model_dir
from engine.models.quantized import build_quantized_model, resolve_quantization, weight_bytes, weight_format
from engine.outputs import StepOutput, StepRecord
from engine.request import Sequence, SequenceStatus, SeqKind
from engine.rerank import JudgePrompt, RerankJob
from engine.runner import DTYPES, ModelRunner, RunnerOutput
from engine.scheduler import Batch, Scheduler

log = logging.getLogger("tandem.engine")


@dataclass(slots=True, eq=False)
class Generation:
    """A live generation request: its sequence and its text stream."""
    request_id: str
    seq: Sequence
    stream: TextStream


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model_dir(config.model)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.hf_config = read_config(self.model_dir)
        self.model_args = LlamaArgs.from_hf_config(self.hf_config)
        self.quantization = resolve_quantization(config)  # "gguf" | "int8" | "none" (see EngineConfig)
        if self.quantization == "none":
            self.model = _build_model(self.model_args, load_state_dict(self.model_dir), config.device, config.dtype)
        else:
            self.model = build_quantized_model(self.model_args, self.model_dir, self.quantization)
        self.weight_bytes, self.weight_format = weight_bytes(self.model), weight_format(self.model)
        log.info("weights: %s, %.1f MB", self.weight_format, self.weight_bytes / 1e6)
        self.max_model_len = min(config.max_model_len or self.model_args.max_position_embeddings,
                                 self.model_args.max_position_embeddings)
        per_block = ModelRunner.kv_bytes_per_block(self.model_args, config.block_size, config.dtype)
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // per_block)
        # A sequence must fit the whole pool, or it would be preempted forever once it outgrew it.
        self.max_model_len = min(self.max_model_len, num_blocks * config.block_size)
        self.pool = BlockPool(num_blocks)
        self.kv = KVCacheManager(self.pool, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, config.device, config.dtype)
        kernels.prepare(config.device, DTYPES[config.dtype])
        if self.runner.device.type == "cuda" and not config.enforce_eager:
            started = time.monotonic()
            if self.runner.capture_decode_graphs(capture_sizes(config.max_num_seqs),
                                                 -(-self.max_model_len // config.block_size), cuda_graph_capture()):
                log.info("captured decode CUDA graphs for batch sizes %s in %.1f s",
                         self.runner.decode_graphs.sizes, time.monotonic() - started)
        self.eos_token_ids = _eos_ids(self.hf_config, self.tokenizer)
        self._judge: JudgePrompt | None = None
        self.cross_encoder = None
        if config.reranker:
            from engine.models.encoder_loader import CrossEncoder

            self.cross_encoder = CrossEncoder.from_pretrained(resolve_model_dir(config.reranker), config.device,
                                                              DTYPES[config.dtype])
            self.runner.cross_encoder = self.cross_encoder
        self._requests: dict[str, Generation | RerankJob] = {}
        self._arrivals = itertools.count()
        self._pending: list[StepOutput] = []
        self._observers: list[Callable[[StepRecord], None]] = []
        self._steps = 0

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, *, messages: list[dict] | None = None) -> None:
        """Queue a generation. Raises ValueError naming the field for bad input; nothing is queued then."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        self._check_new_id(request_id)
        token_ids = self._prompt_token_ids(prompt, messages)
        self._check_fits(token_ids)
        seq = Sequence(request_id=request_id, token_ids=list(token_ids), num_prompt_tokens=len(token_ids),
                       params=params, arrival=next(self._arrivals), arrival_time=time.monotonic(),
                       priority=params.priority)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        self._requests[request_id] = Generation(request_id, seq, TextStream(self.tokenizer, params.stop))
        self.scheduler.add(seq)

    def add_rerank(self, request_id: str, query: str, documents: list[str],
                   params: RerankParams | None = None) -> None:
        """Queue a rerank job: one prefill-only pair per document, scored in the same steps as generation."""
        params = params if params is not None else RerankParams()
        if not isinstance(params, RerankParams):
            raise ValueError("params must be a RerankParams")
        self._check_new_id(request_id)
        if not isinstance(query, str) or not query.strip():
            raise ValueError("query must be a non-empty string")
        if not isinstance(documents, (list, tuple)) or not documents:
            raise ValueError("documents must be a non-empty list of strings")
        if len(documents) > self.config.max_rerank_documents:
            raise ValueError(f"documents has {len(documents)} items; max_rerank_documents is "
                             f"{self.config.max_rerank_documents}")
        if any(not isinstance(d, str) for d in documents):
            raise ValueError("documents must all be strings")
        job = RerankJob(request_id, query, list(documents), params, arrival_time=time.monotonic(),
                        scores=[None] * len(documents), remaining=len(documents))
        if self.cross_encoder is not None:
            pairs = self._encoder_pairs(query, job.documents, params)
        else:
            pairs = [(ids, None) for ids in self._judge_pairs(query, job.documents, params)]
        share_prefix = self.cross_encoder is None and self.config.enable_prefix_caching
        for i, (ids, types) in enumerate(pairs):
            pair = Sequence(request_id=request_id, token_ids=ids, num_prompt_tokens=len(ids), params=params,
                            arrival=next(self._arrivals), arrival_time=job.arrival_time, kind=SeqKind.RERANK,
                            priority=params.priority, owner=job, pair_index=i,
                            wait_for=job.pairs[0] if job.pairs and share_prefix else None,
                            uses_kv=self.cross_encoder is None, token_type_ids=types)
            job.pairs.append(pair)
        self._requests[request_id] = job
        for pair in job.pairs:
            self.scheduler.add(pair)

    def _encoder_pairs(self, query: str, documents: list[str], params: RerankParams):
        # A pair is atomic, so it must also fit one step's token budget.
        return self.cross_encoder.tokenize_pairs(query, documents, max_length=self.scheduler.budget,
                                                 truncate=params.truncate)

    def _judge_pairs(self, query: str, documents: list[str], params: RerankParams) -> list[list[int]]:
        if self._judge is None:
            self._judge = JudgePrompt(self.tokenizer)
            self.runner.judge_token_ids = (self._judge.yes_id, self._judge.no_id)
        prefix, suffix = self._judge.split(query, params.instruction)
        # A pair is atomic: it must fit one step's budget as well as the context.
        limit = min(self.max_model_len - 1, self.scheduler.budget)
        room = limit - len(prefix) - len(suffix)
        if room < 1:
            raise ValueError(f"query is too long: the rendered prompt leaves no room for a document "
                             f"(limit {limit} tokens)")
        pairs = []
        for i, doc in enumerate(documents):
            doc_ids = self._judge.document_ids(doc)
            if len(doc_ids) > room:
                if params.truncate == "none":
                    raise ValueError(f"documents[{i}] with the query is {len(prefix) + len(doc_ids) + len(suffix)} "
                                     f"tokens, over the limit of {limit}; shorten it or use truncate='end'")
                doc_ids = doc_ids[:room]
            pairs.append(prefix + doc_ids + suffix)
        return pairs

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks are freed now, its final output comes with the next step."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        for seq in self._seqs_of(req):
            if not seq.status.finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._pending.append(self._final_output(req, "abort"))
        return True

    @staticmethod
    def _seqs_of(req: Generation | RerankJob) -> list[Sequence]:
        return req.pairs if isinstance(req, RerankJob) else [req.seq]

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    def add_observer(self, fn: Callable[[StepRecord], None]) -> None:
        self._observers.append(fn)

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
        }

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        start = time.monotonic()
        batch = self.scheduler.schedule()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = start
        outputs, self._pending = self._pending, []
        forward_s = 0.0
        if batch.seqs:
            try:
                result = self.runner.run(batch)
            except Exception as exc:  # one bad step fails its own requests, not the engine
                log.exception("model step failed")
                outputs.extend(self._fail_batch(batch, f"model step failed: {exc!r}"))
            else:
                forward_s = result.forward_s
                self.scheduler.update(batch, result.sampled)
                outputs.extend(self._process(batch, result))
        self._steps += 1
        self._emit_record(batch, start, forward_s)
        return outputs

    def _process(self, batch: Batch, result: RunnerOutput) -> list[StepOutput]:
        outputs = []
        now = time.monotonic()
        for seq, score in zip(batch.seqs, result.scores):
            if score is not None:
                outputs.extend(self._record_score(seq, score))
        for seq, token in zip(batch.seqs, result.sampled):
            if token is None or seq.status is not SequenceStatus.RUNNING:
                continue
            req = self._requests[seq.request_id]
            if seq.first_token_time is None:
                seq.first_token_time = now
            text = req.stream.add(token)
            status = self._stop_status(seq, token, req.stream)
            if status is None:
                outputs.append(StepOutput(request_id=seq.request_id, kind="generate", new_token_ids=[token],
                                          text=text, completion_tokens=seq.num_output_tokens,
                                          prompt_tokens=seq.num_prompt_tokens,
                                          cached_tokens=seq.num_cached_tokens,
                                          first_token_time=seq.first_token_time, arrival_time=seq.arrival_time))
                continue
            self.scheduler.finish(seq, status)
            del self._requests[seq.request_id]
            out = self._final_output(req, status.finish_reason)
            out.new_token_ids = [token]
            out.text = text + out.text
            outputs.append(out)
        return outputs

    def _record_score(self, pair: Sequence, score: float) -> list[StepOutput]:
        job: RerankJob = pair.owner
        self.scheduler.finish(pair, SequenceStatus.FINISHED_STOPPED)
        job.scores[pair.pair_index] = score
        job.remaining -= 1
        if job.remaining:
            return []
        del self._requests[job.request_id]
        return [self._final_output(job, "stop")]

    def _stop_status(self, seq: Sequence, token: int, stream: TextStream) -> SequenceStatus | None:
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids or stream.stopped:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _final_output(self, req: Generation | RerankJob, reason: str, error: str | None = None) -> StepOutput:
        if isinstance(req, RerankJob):
            started = [p.first_scheduled_time for p in req.pairs if p.first_scheduled_time is not None]
            return StepOutput(request_id=req.request_id, kind="rerank", finished=True, finish_reason=reason,
                              error=error, scores=list(req.scores) if reason == "stop" else None,
                              prompt_tokens=req.prompt_tokens, cached_tokens=req.cached_tokens,
                              arrival_time=req.arrival_time,
                              queue_time_s=min(started) - req.arrival_time if started else None)
        seq = req.seq
        return StepOutput(request_id=req.request_id, kind="generate", text=req.stream.finish(),
                          finished=True, finish_reason=reason, error=error,
                          prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens,
                          completion_tokens=seq.num_output_tokens, first_token_time=seq.first_token_time,
                          arrival_time=seq.arrival_time,
                          queue_time_s=(seq.first_scheduled_time - seq.arrival_time
                                        if seq.first_scheduled_time is not None else None))

    def _fail_batch(self, batch: Batch, message: str) -> list[StepOutput]:
        outputs = []
        for seq in batch.seqs:
            req = self._requests.pop(seq.request_id, None)
            if req is None:
                continue
            for s in self._seqs_of(req):
                if not s.status.finished:
                    self.scheduler.finish(s, SequenceStatus.FINISHED_ERROR)
            outputs.append(self._final_output(req, "error", message))
        return outputs

    def _emit_record(self, batch: Batch, start: float, forward_s: float) -> None:
        if not self._observers:
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
            decode_request_ids=batch.decode_request_ids, forward_s=forward_s)
        for fn in self._observers:
            fn(record)

    # ---- validation ----------------------------------------------------------------------------

    def _check_new_id(self, request_id: str) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")

    def _prompt_token_ids(self, prompt, messages) -> list[int]:
        if messages is not None:
            if prompt is not None:
                raise ValueError("give either prompt or messages, not both")
            return self.chat_token_ids(messages)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("prompt must not be empty")
            vocab = self.model_args.vocab_size
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
            return list(prompt)
        raise ValueError("prompt must be a string or a list of token ids")

    def chat_token_ids(self, messages: list[dict]) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content}")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a string role and string content")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _check_fits(self, token_ids: list[int]) -> None:
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                             "(prompt plus at least one generated token must fit)")


def _build_model(args: LlamaArgs, state: dict, device: str, dtype: str) -> LlamaForCausalLM:
    # Built on the meta device so no time goes into random init of weights we overwrite.
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    model.load_hf_state_dict({k: v.to(DTYPES[dtype]) for k, v in state.items()}, assign=True)
    return model.to(device).eval()


def _eos_ids(hf_config: dict, tokenizer) -> set[int]:
    ids = hf_config.get("eos_token_id")
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
