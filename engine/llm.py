"""The offline facade: generate, chat and rerank in one call, stepping the engine to completion."""
from __future__ import annotations

import itertools

from engine.config import EngineConfig, RerankParams, SamplingParams
from engine.engine import LLMEngine
from engine.outputs import RequestOutput, RerankResult, rank_scores


class LLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        if config is not None and kwargs:
            raise ValueError("pass either an EngineConfig or keyword options, not both")
        self.engine = LLMEngine(config or EngineConfig(**kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, or a list of token-id lists."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([dict(prompt=p) for p in prompts], params)

    def chat(self, conversations, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or a list of them; applies the chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run([dict(messages=c) for c in conversations], params)

    def rerank(self, query: str, documents: list[str], params: RerankParams | None = None, *,
               ranked: bool = False) -> list[float] | list[RerankResult]:
        """Relevance scores of documents for the query, in input order; with ranked=True the answer the service
        gives: RerankResult(index, score, document) sorted by score, at most params.top_n, documents included with
        params.return_documents (those two shape only a ranked answer, so without ranked=True they are rejected)."""
        if params is not None and not ranked and (params.top_n is not None or params.return_documents):
            raise ValueError("top_n and return_documents shape a ranked answer: call rerank(..., ranked=True)")
        request_id = f"rerank-{next(self._ids)}"
        self.engine.add_rerank(request_id, query, documents, params)
        scores = None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id == request_id and out.finished:
                    if out.error:
                        raise RuntimeError(out.error)
                    scores = out.scores
        if not ranked:
            return scores
        params = params or RerankParams()
        return rank_scores(scores, documents, params.top_n, params.return_documents)

    def _run(self, requests: list[dict], params) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(requests)
        if len(params) != len(requests):
            raise ValueError(f"got {len(params)} SamplingParams for {len(requests)} prompts")
        ids = [f"gen-{next(self._ids)}" for _ in requests]
        added = []
        prompts: dict[str, list[int]] = {}
        try:
            for rid, req, p in zip(ids, requests, params):
                prompts[rid] = self.engine.add_request(rid, params=p, **req)
                added.append(rid)
        except ValueError:
            for rid in added:
                self.engine.abort(rid)
            self._drain()
            raise
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id not in tokens:
                    continue
                tokens[out.request_id].extend(out.new_token_ids)
                texts[out.request_id].append(out.text)
                if out.finished:
                    results[out.request_id] = RequestOutput(
                        request_id=out.request_id, prompt_token_ids=prompts[out.request_id],
                        token_ids=tokens[out.request_id], text="".join(texts[out.request_id]),
                        finish_reason=out.finish_reason, cached_tokens=out.cached_tokens)
        return [results[rid] for rid in ids]

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()
