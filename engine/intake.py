"""Request intake: check and tokenize what a caller submits, before anything reaches the scheduler.

Every check raises ValueError naming the field, so the service can answer INVALID_ARGUMENT and nothing is queued
(NotLoaded, a ValueError, where the engine lacks what the request needs: FAILED_PRECONDITION). These checks are the
only ones: the service's core API and its doors do not repeat them (an empty input, the document and input counts,
no embedder), they pass what the engine says on.

One method per kind of work (generation, rerank, embed), each taking its spec (engine/specs.py); `job(spec)` picks it
from one table keyed by the spec's type (`_BUILDERS`), so `LLMEngine.prepare` and its callers never branch on the
kind.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import xxhash

from engine import chat_templates
from engine.config import EmbedParams, EngineConfig, PoolingTask, RerankParams, SamplingParams
from engine.detokenizer import TextStream
from engine.embed import EmbedJob, Embedder
from engine.embed.embedder import FLAGS
from engine.errors import InputTooLong, NotLoaded
from engine.generation import Generation
from engine.jobs import Job
from engine.rerank import PairPhase, PairScorer, RerankJob
from engine.rerank.pairs import covered, split_windows
from engine.request import RerankPair, RowExec, Sequence, SeqKind
from engine.specs import EmbedSpec, GenerateSpec, JobSpec, RerankSpec

if TYPE_CHECKING:
    from engine.structured import GrammarCompiler


class RequestIntake:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, max_model_len: int, budget: int,
                 scorer: PairScorer, grammar_compiler: "Callable[[], GrammarCompiler] | None" = None,
                 max_model_len_by: str = "max_model_len", embedder: Embedder | None = None,
                 poolers: dict[PoolingTask, Embedder] | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.budget = budget  # tokens of one step: a cross-encoder pair runs whole, so it must fit
        self.max_model_len_by = max_model_len_by  # what sets max_model_len, named in errors
        self.scorer = scorer
        self.embedder = embedder
        # Every pooling encoder by task: an EmbedSpec's params.task picks the one that runs its rows
        self.poolers = poolers if poolers is not None else ({PoolingTask.EMBED: embedder} if embedder else {})
        self.grammar_compiler = grammar_compiler  # called only for a request with structured_outputs
        self._arrivals = itertools.count()
        # A chat stops at its template's end-of-turn tokens as at EOS (Gemma's <end_of_turn> is not its GGUF's EOS).
        self.end_of_turn_ids = chat_templates.end_of_turn_ids(tokenizer, getattr(tokenizer, "chat_template", None))

    def job(self, spec: JobSpec) -> Job:
        """The checked, tokenized job of a request of any kind (not queued): reads the tokenizers and the engine's
        fixed parts only, so any thread may call it. Raises ValueError naming the field (NotLoaded where the engine
        lacks a model), TypeError for a spec this intake has no builder for."""
        build = _BUILDERS.get(type(spec))
        if build is None:
            raise TypeError(f"no intake for a {type(spec).__name__}: the engine takes "
                            f"{', '.join(t.__name__ for t in _BUILDERS)}")
        return build(self, spec)

    def generation(self, spec: GenerateSpec) -> Generation:
        """n sequences over the same prompt. Completion 0 prefills it; the others wait for that and share its full
        blocks. With prompt_logprobs, completion 0 scores every prompt position from 1 on, so a prefix the cache
        holds is recomputed for it (a cached position has no logits), never refused."""
        request_id = spec.request_id
        params = spec.params if spec.params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        token_ids = self.prompt_token_ids(spec.prompt, spec.messages, spec.tools)
        if (spec.chat or spec.messages is not None) and not params.ignore_eos:
            params = self._stop_at_end_of_turn(params)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                             "(prompt plus at least one generated token must fit)")
        if params.max_tokens is None:  # unset: what is left of the context (vLLM's default)
            params = dataclasses.replace(params, max_tokens=self.max_model_len - len(token_ids))
        if len(token_ids) + params.max_tokens > self.max_model_len:  # refused, as vLLM does, never clamped
            raise ValueError(f"max_tokens is too large: {params.max_tokens}; the prompt has {len(token_ids)} tokens "
                             f"and max_model_len is {self.max_model_len}, so max_tokens can be at most "
                             f"{self.max_model_len - len(token_ids)}")
        self._check_token_params(params)
        grammar = self._grammar(params)  # compiled before anything is built: a bad schema queues nothing
        arrival_time = time.monotonic()
        seqs: list[Sequence] = []
        for i in range(params.n):
            seq = Sequence(request_id=request_id, token_ids=list(token_ids), num_prompt_tokens=len(token_ids),
                           params=params, arrival=next(self._arrivals), arrival_time=arrival_time,
                           priority=params.priority, index=i, fork_of=seqs[0] if seqs else None,
                           generator=_generator(params.seed, i), grammar=grammar() if grammar else None)
            seqs.append(seq)
        if params.prompt_logprobs is not None:
            seqs[0].logprob_start = 1
            seqs[0].num_prompt_logprobs = params.prompt_logprobs
        streams = [TextStream(self.tokenizer, params.stop, params.min_tokens, params.skip_special_tokens)
                   for _ in seqs]
        return Generation(request_id, seqs, streams, finish_reasons=[None] * params.n)

    def _stop_at_end_of_turn(self, params: SamplingParams) -> SamplingParams:
        """A chat's params with the template's end-of-turn ids among its stop ids (masked under min_tokens and left
        out with ignore_eos, as EOS is), as llama.cpp ends generation at a template's end-of-generation tokens."""
        extra = [t for t in self.end_of_turn_ids if t not in params.stop_token_ids]
        if not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *extra])

    def _check_token_params(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")

    def _grammar(self, params: SamplingParams) -> "Callable[[], object] | None":
        """A factory of fresh matchers (one per completion) for the request's compiled grammar; None: no grammar."""
        if params.structured_outputs is None:
            return None
        if self.grammar_compiler is None:
            raise ValueError("structured_outputs is not supported by this engine")
        compiler = self.grammar_compiler()
        compiled = compiler.compile(params.structured_outputs)
        return lambda: compiler.matcher(compiled)

    def rerank(self, spec: RerankSpec) -> RerankJob:
        """A job with one prefill-only pair sequence per document."""
        request_id, query, documents = spec.request_id, spec.query, spec.documents
        params = spec.params if spec.params is not None else RerankParams()
        if not isinstance(params, RerankParams):
            raise ValueError("params must be a RerankParams")
        if not isinstance(query, str) or not query.strip():
            raise ValueError("query must be a non-empty string")
        if not isinstance(documents, (list, tuple)) or not documents:
            raise ValueError("documents must be a non-empty list of strings")
        if len(documents) > self.config.max_rerank_documents:
            raise ValueError(f"documents has {len(documents)} items; this server takes at most "
                             f"{self.config.max_rerank_documents} per request (--max-documents, "
                             "EngineConfig.max_rerank_documents); split the request")
        if any(not isinstance(d, str) for d in documents):
            raise ValueError("documents must all be strings")
        job = RerankJob(request_id, query, list(documents), params, arrival_time=time.monotonic(),
                        scores=[None] * len(documents), span_logprobs=[[] for _ in documents],
                        windows=[1] * len(documents))
        scorer = self.scorer
        windows = self.max_windows(params)
        if scorer.pair_phase is not PairPhase.NEVER:
            # fusion and cascade: windows are the embedder's (its rows); their LLM pair reads the document whole (cut
            # at the context, as without windows), one pair per document
            self._rerank_pairs(job, 1 if scorer.embeds else windows)
        if scorer.embeds:
            self._rerank_rows(job, windows)
        return job

    def max_windows(self, params: RerankParams) -> int:
        """The most windows a document of this request may be scored as."""
        return params.max_windows if params.max_windows is not None else self.config.rerank_max_windows



    def _rerank_pairs(self, job: RerankJob, max_windows: int = 1) -> None:
        """One prefill-only pair sequence per document (per window of a long one): queued now, or held until the
        embedder rows have run (PairPhase.AFTER_ROWS: the cascade queues the chosen ones, RerankJob.release)."""
        scorer, params = self.scorer, job.params
        limit, limit_by = self.rerank_limit()
        pairs, shared = scorer.pairs(job.query, job.documents, params, limit, limit_by, max_windows,
                                     self.config.rerank_window_overlap)
        firsts = [p for j, p in enumerate(pairs) if j == 0 or pairs[j - 1].document != p.document]
        job.document_tokens = [p.document_tokens for p in firsts]
        job.truncated = [p.truncated for p in firsts]
        job.windows = [p.windows for p in firsts]
        if len(pairs) != len(job.documents):  # windows: scores per pair, pooled per document when the job ends
            job.pair_units = [p.document for p in pairs]
            job.scores = [None] * len(pairs)
            job.span_logprobs = [[] for _ in pairs]
        # Later pairs wait for the first when it fills at least one full block of their shared prefix.
        wait = scorer.runs_on_llm and self.config.enable_prefix_caching and shared >= self.config.block_size
        at_once = scorer.pair_phase is PairPhase.AT_ONCE
        seqs = []
        for i, pair in enumerate(pairs):
            first = seqs[0] if seqs and wait and at_once else None
            seqs.append(Sequence(
                request_id=job.request_id, token_ids=pair.token_ids, num_prompt_tokens=len(pair.token_ids),
                params=params, arrival=next(self._arrivals), arrival_time=job.arrival_time, kind=SeqKind.RERANK,
                priority=params.priority, execution=RowExec.CAUSAL if scorer.runs_on_llm else RowExec.ENCODER, logprob_start=pair.logprob_start,
                pair=RerankPair(i, wait_for=first, token_type_ids=pair.token_type_ids),
                stages=1 if scorer.runs_on_llm else scorer.stages))
        if at_once:
            job.pairs = seqs
            job.remaining += len(seqs)
        else:  # counted in `remaining` as release() queues the chosen ones
            job.held, job.wait_for_first = seqs, wait

    def _rerank_rows(self, job: RerankJob, max_windows: int = 1) -> None:
        """An embedding mode's rows: the query's, then each document's (cut to the embedder's limit as an embedding
        request's are), in the same steps as any pairs. Where they alone score (the dense mode) they are what the
        response's document_tokens and truncated describe, and truncate='none' refuses a document they would cut."""
        embedder = self.embedder
        if embedder is None:
            raise ValueError(f"the {self.scorer.mode} rerank mode needs an embedder, and this engine has none")
        params = EmbedParams(priority=job.params.priority)
        cut = job.params.max_document_tokens
        if max_windows > 1:  # a long document in windows of the embedder's limit
            rows = embedder.rows([job.query], None, params) + self._window_rows(job, max_windows, cut, params)
        elif cut is None:
            rows = embedder.rows([job.query, *job.documents], None, params)
        else:  # the documents' own tokens cut to `cut` (each text still tokenized once)
            ids = [embedder.with_special_tokens(list(d)[:cut])
                   for d in embedder.tokenizer(job.documents, add_special_tokens=False).input_ids]
            rows = embedder.rows([job.query], None, params) + embedder.rows(None, ids, params)
        if self.scorer.pair_phase is PairPhase.NEVER and max_windows == 1:
            self._describe_documents(job, rows[1:])
        job.rows = self._embed_sequences(job.request_id, rows, params, job.arrival_time,
                                         "a document has too many embedder tokens")
        job.vectors = [None] * len(rows)
        job.remaining += len(rows)

    def _window_rows(self, job: RerankJob, max_windows: int, cut: int | None, params: EmbedParams) -> list:
        """The document rows when documents may be windowed: each document's embedder tokens (cut to `cut` first)
        as up to `max_windows` overlapping windows of the embedder's limit, one row each; the job's windows, and in
        the dense mode (where the rows alone score) its documents' tokens covered and cuts, truncate='none' refusing
        one that needs more windows."""
        embedder = self.embedder
        room = embedder.max_length - embedder.num_special_tokens
        overlap = self.config.rerank_window_overlap
        alone = self.scorer.pair_phase is PairPhase.NEVER
        ids = []
        units, windows, covered_tokens, truncated = [], [], [], []
        for i, doc in enumerate(embedder.tokenizer(job.documents, add_special_tokens=False).input_ids):
            doc = list(doc)[:cut] if cut is not None else list(doc)
            parts, cut_off = split_windows(doc, room, overlap, max_windows)
            if cut_off and job.params.truncate == "none" and alone:
                raise InputTooLong(f"documents[{i}] is over {max_windows} windows of the embedder's limit of "
                                   f"{embedder.max_length} tokens ({embedder.name}): shorten it, send more "
                                   "max_windows or use truncate='end'")
            ids += [embedder.with_special_tokens(p) for p in parts]
            units += [i] * len(parts)
            windows.append(len(parts))
            covered_tokens.append(covered(parts, room, overlap))
            truncated.append(cut_off)
        if alone:
            job.document_tokens, job.truncated = covered_tokens, truncated
        job.windows = windows
        if len(units) != len(job.documents):
            job.row_units = units
        return embedder.rows(None, ids, params)

    def _describe_documents(self, job: RerankJob, rows: list) -> None:
        """document_tokens and truncated from the documents' embedder rows; ValueError for a cut one under
        truncate='none'."""
        specials = self.embedder.num_special_tokens
        if job.params.truncate == "none":
            cut = next((i for i, r in enumerate(rows) if r.truncated), None)
            if cut is not None:
                raise ValueError(f"documents[{cut}] is over the embedder's limit of {self.embedder.max_length} "
                                 f"tokens ({self.embedder.name}): shorten it or use truncate='end'")
        job.document_tokens = [len(r.token_ids) - specials for r in rows]
        job.truncated = [r.truncated for r in rows]

    def _embed_sequences(self, request_id: str, rows: list, params: EmbedParams, arrival_time: float,
                         too_long: str, encoder: Embedder | None = None) -> list[Sequence]:
        """One KV-free EMBED sequence per embedder row, input order, each run in the embedder's stages; ValueError
        (`too_long`, the budget) when one stage of a row exceeds one step's budget (a decoder embedder's row is one
        stage: it runs whole). `encoder`: the one that runs them (None: the embedder)."""
        encoder = encoder or self.embedder
        seqs = [Sequence(request_id=request_id, token_ids=row.token_ids, num_prompt_tokens=len(row.token_ids),
                         params=params, arrival=next(self._arrivals), arrival_time=arrival_time, kind=SeqKind.EMBED,
                         priority=params.priority, execution=RowExec.ENCODER, index=i, stages=encoder.stages,
                         token_type_ids=row.token_type_ids)
                for i, row in enumerate(rows)]
        if any(seq.stage_tokens(1) > self.budget for seq in seqs):
            what = "one layer of it" if encoder.stages > 1 else "it runs whole and"
            raise ValueError(f"{too_long}: {what} must fit in one step's budget ({self.budget}, "
                             "--max-num-batched-tokens)")
        return seqs

    def embed(self, spec: EmbedSpec) -> EmbedJob:
        """A job with one prefill-only, KV-free row per input (texts, or token ids in the embedder's vocabulary), run
        by the encoder of its params' task (the embedder, the classifier, the sparse embedder)."""
        request_id, inputs = spec.request_id, spec.inputs
        params = spec.params if spec.params is not None else EmbedParams()
        if not isinstance(params, EmbedParams):
            raise ValueError("params must be an EmbedParams")
        embedder = self.poolers.get(params.task)
        if embedder is None and params.task is not PoolingTask.EMBED:
            raise NotLoaded(f"this server has no {_MODELS[params.task]} (tandem serve {FLAGS[params.task]} "
                            f"DIR|HUB_ID; EngineConfig.{_FIELDS[params.task]})")
        if embedder is None:
            raise NotLoaded("this server has no embedding model (tandem serve --embedder DIR, or leave the default: "
                            "the embedded all-MiniLM-L6-v2; EngineConfig.embedder)")
        if not isinstance(inputs, (list, tuple)):
            raise ValueError("input must be a list of strings or of token id lists")
        if not inputs:
            raise ValueError("input must not be empty: give one or more texts (or token id lists)")
        if len(inputs) > self.config.max_embed_inputs:
            raise ValueError(f"input has {len(inputs)} items; this server takes at most {self.config.max_embed_inputs}"
                             " per request (--max-embed-inputs, EngineConfig.max_embed_inputs); split the request")
        texts = ids = None
        if all(isinstance(t, str) or _text_pair(t) for t in inputs):
            if any(not t for t in inputs) or any(not isinstance(t, str) and not all(t) for t in inputs):
                raise ValueError("input must not contain empty strings")
            texts = [t if isinstance(t, str) else tuple(t) for t in inputs]
            if params.task is not PoolingTask.CLASSIFY and any(isinstance(t, tuple) for t in texts):
                raise ValueError("input: text pairs ([text, text_pair]) are classified only (a sequence classifier "
                                 "reads the pair, as a cross-encoder or an NLI model does); give texts")
        elif all(isinstance(t, (list, tuple)) for t in inputs):
            vocab = len(embedder.tokenizer)
            for i, t in enumerate(inputs):
                if not t or any(not isinstance(x, int) or isinstance(x, bool) for x in t):
                    raise ValueError(f"input[{i}] must be a non-empty list of token ids in [0, {vocab}) (the "
                                     f"embedder {embedder.name}'s vocabulary)")
                outside = next((x for x in t if not 0 <= x < vocab), None)
                if outside is not None:
                    raise ValueError(_foreign_ids(i, outside, vocab, embedder.name))
            ids = [list(t) for t in inputs]
        else:
            raise ValueError("input must be all strings or all token id lists")
        embedder.check_dimensions(params)
        rows = embedder.rows(texts, ids, params)
        arrival_time = time.monotonic()
        sequences = self._embed_sequences(request_id, rows, params, arrival_time, "an input has too many tokens",
                                          embedder)
        return EmbedJob(request_id, params, arrival_time=arrival_time, rows=sequences, vectors=[None] * len(rows),
                        remaining=len(rows), truncated=[r.truncated for r in rows])

    def rerank_limit(self) -> tuple[int, str]:
        """The most tokens one rerank pair (template, query and document) may have, and what sets that limit.

        A pair the LLM scores is prefilled in chunks across steps like a prompt, so it may fill the model's context;
        a cross-encoder pair runs whole in one step, within its own max_position_embeddings and the step's budget; a
        mode without pairs (dense) sees a document through the embedder, within its limit."""
        if self.scorer.pair_phase is PairPhase.NEVER and self.embedder is not None:
            return self.embedder.max_length, f"the embedder {self.embedder.name}'s limit, special tokens included"
        if self.scorer.runs_on_llm:
            return self.max_model_len, self.max_model_len_by
        own = self.scorer.max_length
        if own is not None and own <= self.budget:
            return own, "the cross-encoder's max_position_embeddings"
        return self.budget, ("max_num_batched_tokens (tandem serve --max-num-batched-tokens): a cross-encoder pair "
                             "runs whole in one step")

    def chat_token_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The chat rendered by the chat template for a reply; `tools` (OpenAI function definitions) in the
        template's own tool format, as transformers renders them."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content}")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a string role and string content")
        if not self.tokenizer.chat_template:
            raise ValueError("messages: this model has no chat template (a base model): start the server with "
                             f"--chat-template NAME ({', '.join(chat_templates.names())}) or a Jinja file "
                             "(EngineConfig.chat_template), or send a prompt instead")
        if tools and "tools" not in self.tokenizer.chat_template:
            raise ValueError("tools: this model's chat template has no tool format (give one that renders tools "
                             "with --chat-template)")
        ids = self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                 tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def prompt_token_ids(self, prompt, messages, tools: list[dict] | None = None) -> list[int]:
        if messages is not None:
            if prompt is not None:
                raise ValueError("give either prompt or messages, not both")
            return self.chat_token_ids(messages, tools)
        if tools:
            raise ValueError("tools need messages (a chat), not a prompt")
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
        if prompt is None:
            raise ValueError("request has no input: set prompt, messages or token_ids")
        raise ValueError("prompt must be a string or a list of token ids")


# The one dispatch on the kind of request: each spec type (engine/specs.py) and the intake method that builds its job.
_BUILDERS: dict[type, Callable[[RequestIntake, Any], Job]] = {
    GenerateSpec: RequestIntake.generation,
    RerankSpec: RequestIntake.rerank,
    EmbedSpec: RequestIntake.embed,
}


def _text_pair(value) -> bool:
    """A classification's text pair: [text, text_pair] (a list or tuple of two strings)."""
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(x, str) for x in value)


_MODELS = {PoolingTask.CLASSIFY: "classifier", PoolingTask.SPARSE: "sparse embedder (SPLADE)"}
_FIELDS = {PoolingTask.CLASSIFY: "classifier", PoolingTask.SPARSE: "sparse_embedder"}


def _generator(seed: int | None, index: int) -> torch.Generator | None:
    """Completion 0 draws from the request's seed itself (so n = 1 is what it always was); completion i > 0 from a
    seed derived from (seed, i), so a seeded request is reproducible and its completions differ."""
    if seed is None:
        return None
    if index == 0:
        return torch.Generator().manual_seed(seed)
    return torch.Generator().manual_seed(xxhash.xxh64_intdigest(f"{seed}/{index}".encode()))


def _foreign_ids(index: int, token: int, vocab: int, name: str) -> str:
    """The refusal of a token id outside the embedder's vocabulary: most likely another tokenizer's ids (LangChain's
    OpenAIEmbeddings sends tiktoken's unless told not to), which would embed as garbage if they happened to fit."""
    return (f"input[{index}] has token id {token}, outside the embedder {name}'s vocabulary [0, {vocab}): token ids "
            "must be this model's own (its tokenizer's input_ids), or send the text. LangChain's OpenAIEmbeddings "
            "sends tiktoken's ids unless given check_embedding_ctx_length=False")
