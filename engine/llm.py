"""The offline facade: generate, chat, rerank and embed in one call, stepping the engine to completion."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TypeVar

from engine.admission import AdmissionPolicy
from engine.config import EmbedParams, EngineConfig, RerankParams, SamplingParams
from engine.engine import LLMEngine
from engine.outputs import (CompletionOutput, EmbedOutput, Logprobs, RequestOutput, RerankOutput, RerankResult,
                            StepOutput, TokenDelta, check_top_n, rank_scores)
from engine.request import FinishReason

Final = TypeVar("Final", bound=StepOutput)


class LLM:
    def __init__(self, config: EngineConfig | None = None, *, admission: AdmissionPolicy | None = None,
                 **kwargs) -> None:
        """`admission`: an AdmissionPolicy object (engine/admission.py) instead of the one the config names."""
        if config is not None and kwargs:
            raise ValueError("pass either an EngineConfig or keyword options, not both")
        self.engine = LLMEngine(config or EngineConfig(**kwargs), admission=admission)
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
               ranked: bool = False, top_n: int | None = None,
               return_documents: bool = False) -> list[float] | list[RerankResult]:
        """Relevance scores of documents for the query, in input order; with ranked=True the answer the service
        gives: RerankResult(index, score, document, document_tokens, truncated) sorted by score, at most `top_n`,
        documents included with `return_documents` (those two shape only a ranked answer, so without ranked=True
        they are rejected; the engine never sees them)."""
        if not ranked and (top_n is not None or return_documents):
            raise ValueError("top_n and return_documents shape a ranked answer: call rerank(..., ranked=True)")
        check_top_n(top_n)
        request_id = f"rerank-{next(self._ids)}"
        self.engine.add_rerank(request_id, query, documents, params)
        final = self._run_to_final(request_id, RerankOutput)
        if not ranked:
            return final.scores
        return rank_scores(final.scores, documents, top_n, return_documents, final.document_tokens,
                           final.truncated, final.windows)

    def embed(self, texts: str | list[str | tuple[str, str]] | list[list[int]], params: EmbedParams | None = None
              ) -> list[list[float]]:
        """One vector per input (texts, or token ids in the embedder's vocabulary), input order; needs
        EngineConfig(embedder=...). With EmbedParams(task=PoolingTask.CLASSIFY) each input's label probabilities
        (EngineConfig.classifier), where an input may also be a text pair (text, text_pair)."""
        request_id = f"embed-{next(self._ids)}"
        self.engine.add_embed(request_id, [texts] if isinstance(texts, str) else texts, params)
        return self._run_to_final(request_id, EmbedOutput).embeddings

    def _run_to_final(self, request_id: str, kind: type[Final]) -> Final:
        """Step until nothing is left; the final output of `request_id`, a `kind` (RuntimeError if the engine failed
        it)."""
        final = None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id == request_id and out.finished:
                    if out.error:
                        raise RuntimeError(out.error)
                    final = out
        if not isinstance(final, kind):
            raise RuntimeError(f"request {request_id} ended without its {kind.__name__}")
        return final

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
        collected = {rid: _Collected(prompts[rid], p.n, p.logprobs is not None) for rid, p in zip(ids, params)}
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                got = collected.get(out.request_id)
                if got is None:
                    continue
                got.add(out)
                if out.finished:
                    results[out.request_id] = got.result(out)
        return [results[rid] for rid in ids]

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()


@dataclass(slots=True)
class _Completion:
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class _Collected:
    """What the step outputs of one request have delivered so far, per completion."""
    prompt_token_ids: list[int]
    n: int
    wants_logprobs: bool
    completions: list[_Completion] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None

    def __post_init__(self) -> None:
        self.completions = [_Completion(logprobs=[] if self.wants_logprobs else None) for _ in range(self.n)]

    def add(self, out: TokenDelta) -> None:
        c = self.completions[out.index]
        c.token_ids.extend(out.new_token_ids)
        c.texts.append(out.text)
        if c.logprobs is not None and out.logprobs is not None:
            c.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finish_reason is not None:
            c.finish_reason = out.finish_reason

    def result(self, last: TokenDelta) -> RequestOutput:
        """The request's RequestOutput once `last` (its finished output) is in; a completion the request's end cut
        short (an error) takes the request's finish reason."""
        outputs = [CompletionOutput(index=i, text="".join(c.texts), token_ids=c.token_ids,
                                    finish_reason=c.finish_reason or last.finish_reason, logprobs=c.logprobs)
                   for i, c in enumerate(self.completions)]
        first = outputs[0]
        return RequestOutput(request_id=last.request_id, prompt_token_ids=self.prompt_token_ids,
                             token_ids=first.token_ids, text=first.text, finish_reason=first.finish_reason,
                             cached_tokens=last.cached_tokens, logprobs=first.logprobs,
                             prompt_logprobs=self.prompt_logprobs, outputs=outputs)
