"""Request intake: check and tokenize what a caller submits, before anything reaches the scheduler.

Every check raises ValueError naming the field, so the service can answer INVALID_ARGUMENT and nothing is queued.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, RerankParams, SamplingParams
from engine.detokenizer import TextStream
from engine.rerank import PairScorer, RerankJob
from engine.request import RerankPair, Sequence, SeqKind


@dataclass(slots=True, eq=False)
class Generation:
    """A live generation request: its sequence and its text stream."""
    request_id: str
    seq: Sequence
    stream: TextStream


class RequestIntake:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, max_model_len: int, budget: int,
                 scorer: PairScorer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.budget = budget  # tokens of one step: a rerank pair is atomic, so it must fit
        self.scorer = scorer
        self._arrivals = itertools.count()

    def generation(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams | None,
                   messages: list[dict] | None) -> Generation:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        token_ids = self._prompt_token_ids(prompt, messages)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                             "(prompt plus at least one generated token must fit)")
        seq = Sequence(request_id=request_id, token_ids=token_ids, num_prompt_tokens=len(token_ids),
                       params=params, arrival=next(self._arrivals), arrival_time=time.monotonic(),
                       priority=params.priority)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        return Generation(request_id, seq, TextStream(self.tokenizer, params.stop))

    def rerank(self, request_id: str, query: str, documents: list[str], params: RerankParams | None) -> RerankJob:
        """A job with one prefill-only pair sequence per document."""
        params = params if params is not None else RerankParams()
        if not isinstance(params, RerankParams):
            raise ValueError("params must be a RerankParams")
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
        scorer = self.scorer
        # A pair is atomic: it must fit one step's budget, and (through the LLM) the context.
        limit = min(self.max_model_len - 1, self.budget) if scorer.runs_on_llm else self.budget
        pairs, shared = scorer.pairs(query, job.documents, params, limit)
        # Later pairs wait for the first when it fills at least one full block of their shared prefix.
        wait = scorer.runs_on_llm and self.config.enable_prefix_caching and shared >= self.config.block_size
        for i, pair in enumerate(pairs):
            first = job.pairs[0] if job.pairs and wait else None
            job.pairs.append(Sequence(
                request_id=request_id, token_ids=pair.token_ids, num_prompt_tokens=len(pair.token_ids),
                params=params, arrival=next(self._arrivals), arrival_time=job.arrival_time, kind=SeqKind.RERANK,
                priority=params.priority, uses_kv=scorer.runs_on_llm, logprob_start=pair.logprob_start,
                pair=RerankPair(job, i, wait_for=first, token_type_ids=pair.token_type_ids)))
        return job

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
            vocab = self.vocab_size
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
            return list(prompt)
        raise ValueError("prompt must be a string or a list of token ids")
