"""The core API: the one typed, async interface both doors call (the shape of vLLM's EngineClient, TEI's Infer).

Engine types in (`SamplingParams`, `RerankParams`, prompts, chat messages, token ids), engine types out
(`TokenDelta`, `RerankResult`) plus the small dataclasses below; never protobuf, never JSON. What a request names
(the model, its task, chat roles) is checked here, so a request is refused the same way whichever door it came
through; what it carries (an empty input, the document and input counts of --max-documents and --max-embed-inputs,
no embedder loaded, a prompt too long, a bad schema) is the engine intake's to check, once (engine/intake.py), and
comes back as a `ServiceError` from the same place (the bridge turns the engine's ValueError into INVALID_ARGUMENT,
its NotLoaded into FAILED_PRECONDITION). Tokenizing never happens on the engine thread: the bridge's intake
thread tokenizes prompts, chats and rerank pairs (and cuts documents to `max_tokens_per_doc` there); `tokenize` runs
on a worker thread.

    core = await CoreAPI.load(bridge, limits)
    stream = core.generate([GenerateInput("a", params, prompt="Hi")], metadata)   # admitted, or ServiceError
    async for event in stream: ...                                                # GenerateEvent per output
    outcome = await core.rerank(RerankInput("r", query, documents, RerankParams()), metadata)

One request id: the core mints it (`new_request_id`, unique in the process) for every request it admits, and the
engine, its step records, the spans, the lifecycle hooks and the HTTP responses' ids (`chatcmpl-<id>`, a rerank's or
embedding's `id`) all use it (`GenerationStream.ids`, `RerankOutcome.id`, `EmbedOutcome.id`). A gRPC client's own
`request_id` stays what it was: that stream's key, echoed in that door's responses (the inputs' `request_id`; the
HTTP door sets none).
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import json
import os
import uuid
from collections import deque
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Iterator, Sequence


from engine.config import MAX_LOGPROBS, MAX_N, EmbedParams, PoolingTask, RerankParams, SamplingParams
from engine.outputs import EmbedOutput, RerankOutput, RerankResult, TokenDelta, rank_scores
from engine.request import FinishReason, SeqKind
from engine.specs import EmbedSpec, GenerateSpec, RerankSpec
from service.errors import ErrorKind, ServiceError, invalid
from service.lifecycle import CLIENT_GONE, RequestLifecycle
from service.tokens import TokenTexts, build_token_texts
from service.tool_calls import ToolPlan, ToolSettings, ToolSupport
from service.tool_calls import plan as plan_tools
from service.tool_calls import support as tool_support

if TYPE_CHECKING:
    from service.bridge import EngineBridge

DEFAULT_MAX_BUFFER_BYTES = 16 * 2**20

_PROCESS_TAG = uuid.uuid4().hex[:8]  # ids of different processes (restarts, replicas) differ
_REQUEST_NUMBERS = itertools.count()


def new_request_id(kind: SeqKind) -> str:
    """The one id of a request, unique in the process: its kind's letter, a number, this process's tag
    (`g12-3fa9c2d1`)."""
    return f"{kind.value[0]}{next(_REQUEST_NUMBERS)}-{_PROCESS_TAG}"


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask for, whichever door it came through. (The document and input counts of one rerank
    or embedding request are the engine's: EngineConfig.max_rerank_documents and max_embed_inputs.)"""
    max_message_bytes: int = 4 * 2**20
    # responses one stream (a gRPC stream, an HTTP response) may hold unread: its one bounded channel
    max_stream_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES


@dataclass(frozen=True, slots=True)
class Names:
    """What a request's `model` may say. `served`: the names to answer to (`--served-model-name`; the first is the
    one responses echo when a request names none); empty: the model's short id (the GGUF file's stem, the Hugging
    Face directory's name, the embedded model's name). A rerank or an embedding naming no model of this replica is
    served by the one reranker or embedder anyway (as TEI does), and a rerank naming the LLM is scored by the
    reranker (as before /v1/models stopped listing the LLM as a reranker), unless `strict`."""
    served: tuple[str, ...] = ()
    strict: bool = False


# OpenAI's chat roles; the chat template decides what it makes of each.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What this replica serves (gRPC ModelInfo, HTTP /v1/models)."""
    model: str = ""
    served_names: tuple[str, ...] = ()
    architecture: str = ""
    max_model_len: int = 0
    block_size: int = 0
    kv_blocks_total: int = 0
    reranker: str = ""  # what scores reranks (engine.model_info: the cross-encoder, the embedder, the LLM, or both)
    rerank_mode: str = ""
    rerank_dtype: str = ""  # what the reranker's forwards run in ("bfloat16 + float32": the embedder's, the LLM's)
    device: str = ""
    dtype: str = ""
    weight_format: str = ""
    weight_bytes: int = 0
    vocab_size: int = 0
    rerank_max_pair_tokens: int = 0
    rerank_limit_by: str = ""
    cpu_kernels: str = ""
    max_waiting: int = 0
    max_documents: int = 0
    max_embed_inputs: int = 0
    max_message_bytes: int = 0
    max_n: int = MAX_N
    max_logprobs: int = MAX_LOGPROBS
    embedder: str = ""  # the embedding model's id ("": none loaded)
    embedder_architecture: str = ""
    embedding_dimensions: int = 0
    embedder_pooling: str = ""
    embedder_max_tokens: int = 0
    embedder_matryoshka: bool = False  # `dimensions` may shorten its vectors
    embedder_dtype: str = ""  # what its forward runs in (--encoder-dtype as resolved on this CPU)
    classifier: str = ""  # the sequence classifier's id ("": none loaded; --classifier)
    classifier_labels: tuple[str, ...] = ()  # its labels, id order (config.json's id2label)
    classifier_max_tokens: int = 0
    sparse_embedder: str = ""  # the SPLADE model's id ("": none loaded; --sparse-embedder)
    sparse_embedder_max_tokens: int = 0


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """One generation: exactly one of prompt (text or token ids) and messages (chat, templated by the engine).
    `params.max_tokens` None (the request set none, through either door): the rest of the context, max_model_len
    minus the prompt's tokens, filled in once the prompt is tokenized (vLLM's default); a value set too large is
    refused, never clamped."""
    request_id: str  # the gRPC client's id (its stream's key; "" from the HTTP door); not the request's id
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    model: str = ""  # "" or a served name
    timeout_ms: int = 0  # 0: none
    tools: list[dict] | None = None  # function definitions the chat template renders (see tool_plan)


# How a request asks for an input too long to be cut instead of refused, in the gRPC API's spelling; each HTTP API
# names its own (TEI's `truncate: true`, Cohere's `truncate: "END"`) in the inputs it builds.
GRPC_CUT_HINT = "set truncate to TRUNCATE_END (or leave it unset) to cut it at its end"


@dataclass(frozen=True, slots=True)
class RerankInput:
    request_id: str
    query: str
    documents: list[str]
    params: RerankParams
    model: str = ""
    timeout_ms: int = 0
    max_tokens_per_doc: int | None = None  # cut each document to its first N tokens before scoring (Cohere)
    cut_hint: str = GRPC_CUT_HINT  # how this request's API asks to cut a document too long (completes the refusal)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    time_to_first_token_s: float = 0.0
    duration_s: float = 0.0

    @classmethod
    def of(cls, lc: RequestLifecycle) -> "Usage":
        return cls(lc.prompt_tokens, lc.cached_tokens, lc.completion_tokens, lc.ttft_s, lc.duration_s)


@dataclass(frozen=True, slots=True)
class GenerateEvent:
    """One step's output of input `index`, or the error that ended it; `usage` on the input's last event."""
    index: int
    request_id: str
    output: TokenDelta | None = None
    error: ServiceError | None = None
    usage: Usage | None = None

    @property
    def last(self) -> bool:
        return self.error is not None or (self.output is not None and self.output.finished)


@dataclass(frozen=True, slots=True)
class RerankOutcome:
    request_id: str  # the client's (RerankInput.request_id)
    results: list[RerankResult]  # highest score first, cut to top_n
    usage: Usage
    mode: str  # the rerank mode that scored it
    id: str = ""  # the request's one id (new_request_id): what the engine, spans and HTTP responses call it
    model: str = ""  # the model that scored it (CoreAPI.rerank_name), whatever name the request gave


@dataclass(frozen=True, slots=True)
class EmbedInput:
    """One embedding request: texts, or token id lists in the embedder's own vocabulary (never both kinds)."""
    request_id: str
    inputs: list[str] | list[list[int]]
    params: EmbedParams
    model: str = ""
    timeout_ms: int = 0
    cut_hint: str = GRPC_CUT_HINT  # how this request's API asks to cut an input too long (completes the refusal)


@dataclass(frozen=True, slots=True)
class EmbedOutcome:
    request_id: str
    embeddings: list[list[float]]  # one per input, input order (params.all_tokens: [tokens][dim] per input)
    truncated: list[bool]  # per input: cut to the embedder's limit
    usage: Usage
    model: str  # the embedder's id
    id: str = ""  # the request's one id (new_request_id)


@dataclass(frozen=True, slots=True)
class ClassifyOutcome:
    """A classification: per input, one probability per label (label id order; the logits with raw_scores)."""
    request_id: str
    scores: list[list[float]]
    labels: tuple[str, ...]  # the classifier's labels, id order
    truncated: list[bool]
    usage: Usage
    model: str  # the classifier's id
    id: str = ""


@dataclass(frozen=True, slots=True)
class SparseOutcome:
    """Sparse embeddings: per input, its non-zero (vocabulary id, weight) pairs, id order."""
    request_id: str
    vectors: list[list[tuple[int, float]]]
    truncated: list[bool]
    usage: Usage
    model: str  # the sparse embedder's id
    id: str = ""


class GenerationStream:
    """The events of one or more admitted generations, in the order the engine produced them; ends when every
    input has sent its last event. `abort()` stops whatever is still running (its last event still arrives).

    The engine never waits for a reader, so events queue here until read, bounded: when the unread events exceed
    `max_buffer_bytes` (their size as text, tokens and log-probabilities), every request of the stream is aborted
    (its KV blocks freed), what was queued is dropped, and each unfinished input ends with RESOURCE_EXHAUSTED.

    A stream is bounded in one place only. With `max_buffer_bytes` None this one counts nothing: its reader moves
    each event on as it arrives into a bounded channel of its own, which is then the stream's only buffer and its
    overflow the only overflow (the gRPC door's StreamSession, one per gRPC stream, whatever its requests). Events
    wait here then only between the engine's hand-off and the reader's next turn on the loop (one step's worth)."""

    def __init__(self, bridge: "EngineBridge", max_buffer_bytes: int | None) -> None:
        self._bridge = bridge
        self._max_bytes = max_buffer_bytes
        self._events: deque[tuple[GenerateEvent, int]] = deque()
        self._buffered = 0
        self._wakeup = asyncio.Event()
        self._lifecycles: list[RequestLifecycle] = []
        self._ids: list[str] = []
        self._read_last: set[int] = set()  # inputs whose last event was read
        self._overflowed = False

    def sink(self, index: int, request_id: str):
        """The bridge's sink for input `index`: TokenDeltas and the ServiceError that may end it."""
        def put(event: TokenDelta | ServiceError) -> None:
            if self._overflowed:
                return
            if isinstance(event, ServiceError):
                item = GenerateEvent(index, request_id, error=event, usage=Usage.of(self._lifecycles[index]))
            elif event.finished:
                item = GenerateEvent(index, request_id, event, usage=Usage.of(self._lifecycles[index]))
            else:
                item = GenerateEvent(index, request_id, event)
            size = 0 if self._max_bytes is None else _size(item)
            if size and self._events and self._buffered + size > self._max_bytes:
                self._overflow()
                return
            self._events.append((item, size))
            self._buffered += size
            self._wakeup.set()
        return put

    def _admitted(self, request_id: str, lc: RequestLifecycle) -> None:
        self._ids.append(request_id)
        self._lifecycles.append(lc)

    def _overflow(self) -> None:
        self._overflowed = True
        dropped = len(self._events)
        self._events.clear()
        self._buffered = 0
        error = ServiceError(ErrorKind.RESOURCE_EXHAUSTED,
                             f"stream buffer full: the client did not read {dropped} queued responses (over "
                             f"{self._max_bytes} bytes, --max-stream-buffer-bytes); its requests were cancelled. "
                             "Read responses as they come")
        for index, request_id in enumerate(self._ids):
            if index not in self._read_last:
                self._events.append((GenerateEvent(index, request_id, error=error), 0))
        self.abort()
        self._wakeup.set()

    @property
    def ids(self) -> list[str]:
        """Each input's one request id (new_request_id), input order."""
        return [lc.engine_id for lc in self._lifecycles]

    def abort(self, *, client_gone: bool = False) -> None:
        """Stop what still runs; `client_gone`: because its client went away (the access log says 499 / CANCELLED,
        not the status of an answer nobody read)."""
        for lc in self._lifecycles:
            if client_gone:
                lc.metadata[CLIENT_GONE] = "1"
            self._bridge.abort(lc.engine_id)

    @property
    def done(self) -> bool:
        """Every input's last event was read."""
        return len(self._read_last) == len(self._ids)

    def __aiter__(self) -> "GenerationStream":
        return self

    async def __anext__(self) -> GenerateEvent:
        while not self._events:
            if len(self._read_last) == len(self._ids):
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()
        event, size = self._events.popleft()
        self._buffered -= size
        if event.last:
            self._read_last.add(event.index)
        return event


def _size(event: GenerateEvent) -> int:
    """Roughly what the event costs to hold and send: its text, tokens and log-probability entries."""
    out = event.output
    if out is None:
        return 64
    entries = sum(len(lp) for lp in out.logprobs or ()) + sum(len(lp or ()) for lp in out.prompt_logprobs or ())
    return 64 + len(out.text) + 8 * len(out.new_token_ids) + 16 * entries


class Task(str, enum.Enum):
    """What a listed model does (HTTP /v1/models' `task` and `capabilities`)."""
    GENERATE = "generate"  # chat and completions
    EMBED = "embed"
    RERANK = "rerank"
    CLASSIFY = "classify"
    EMBED_SPARSE = "embed_sparse"

    __format__ = str.__format__


_VERBS = {Task.GENERATE: "generate (chat, completions)", Task.EMBED: "embed", Task.RERANK: "rerank",
          Task.CLASSIFY: "classify", Task.EMBED_SPARSE: "embed sparse"}
# The pooling tasks past embeddings: the engine's task, the ModelInfo field naming the model, the flag loading it
_POOLERS = {Task.CLASSIFY: (PoolingTask.CLASSIFY, "classifier", "--classifier"),
            Task.EMBED_SPARSE: (PoolingTask.SPARSE, "sparse_embedder", "--sparse-embedder")}
# The rerank modes the LLM scores in (engine RerankMode values), alone or beside the embedder; the embedder's cosine
# scores in dense, fusion and cascade.
_LLM_SCORES = ("likelihood", "judge", "fusion", "cascade")
_EMBEDDER_SCORES = ("dense", "fusion", "cascade")


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model this replica serves and the kinds of work it does (HTTP /v1/models, gRPC ModelInfo.models), the
    served LLM's names first; `max_tokens`: its input limit (the LLM's context, the embedder's input, a
    cross-encoder's pair)."""
    name: str
    tasks: tuple[Task, ...]
    max_tokens: int


class CoreAPI:
    """generate / rerank / abort / tokenize / model_info over a started EngineBridge."""

    def __init__(self, bridge: "EngineBridge", limits: Limits, info: ModelInfo, token_texts: TokenTexts,
                 tokenizer: Any, names: Names = Names(), aliases: tuple[str, ...] = (),
                 tools: ToolSupport = ToolSupport()) -> None:
        self.tools = tools  # what the served model can do with a request's tools
        self.bridge = bridge
        self.limits = limits
        self.info = info
        self.token_texts = token_texts  # each token id's text and bytes (OpenAI logprobs)
        self._tokenizer = tokenizer  # read-only here, on worker threads
        self._strict = names.strict
        self._accepted = {"", *info.served_names, *aliases}

    @classmethod
    async def load(cls, bridge: "EngineBridge", limits: Limits, names: Names = Names(),
                   tools: ToolSettings | ToolSupport = ToolSettings()) -> "CoreAPI":
        """Ask the engine what it serves; build the token texts on a worker thread."""
        engine_info = await bridge.model_info()
        tokenizer = bridge.engine.tokenizer
        texts = await asyncio.to_thread(build_token_texts, tokenizer, engine_info["vocab_size"])
        given = str(engine_info["model"])  # the path as the operator gave it (or the embedded model's name)
        served = tuple(dict.fromkeys(names.served)) or (short_name(given),)
        known = {f.name for f in fields(ModelInfo)}
        config = bridge.engine.config  # the engine checks these counts (engine/intake.py); ModelInfo tells them
        info = ModelInfo(**{k: v for k, v in engine_info.items() if k in known and k not in ("model", "served_names")},
                         model=served[0], served_names=served, max_waiting=bridge.max_waiting,
                         max_documents=config.max_rerank_documents, max_embed_inputs=config.max_embed_inputs,
                         max_message_bytes=limits.max_message_bytes)
        # Without --served-model-name the path as given still names the model (clients written against it keep
        # working); it is not listed.
        if isinstance(tools, ToolSettings):  # the flags: resolved against the served model (ValueError: they cannot be)
            tools = tool_support(tools, tokenizer.chat_template, bridge.engine.hf_config.get("model_type"), tokenizer)
        return cls(bridge, limits, info, texts, tokenizer, names, aliases=() if names.served else (given,),
                   tools=tools)

    # ---- checks that need no engine --------------------------------------------------------------

    @property
    def rerank_model(self) -> str:
        """The cross-encoder's id ("" in the other modes: the embedder, the LLM or both score reranks then)."""
        return short_name(self.info.reranker) if self.info.rerank_mode == "cross-encoder" else ""

    @property
    def rerank_name(self) -> str:
        """The id of what scores reranks, as responses and the access log name it: the cross-encoder's, the
        embedder's (dense), the LLM's served name (likelihood, judge), or both (`all-MiniLM-L6-v2+SmolLM2-135M-Instruct`:
        fusion and cascade)."""
        info = self.info
        if info.rerank_mode == "cross-encoder":
            return self.rerank_model
        if info.rerank_mode == "dense":
            return info.embedder
        if info.rerank_mode in ("fusion", "cascade"):
            return f"{info.embedder}+{info.model}"
        return info.model

    def models(self) -> list[ServedModel]:
        """Each model this replica serves with what it does: the LLM's names generate (and rerank in the modes it
        scores in), the embedder embeds (and reranks in the modes its cosine scores in), a cross-encoder reranks."""
        info, mode = self.info, self.info.rerank_mode
        llm = (Task.GENERATE, Task.RERANK) if mode in _LLM_SCORES else (Task.GENERATE,)
        out = {name: ServedModel(name, llm, info.max_model_len) for name in info.served_names}
        if info.embedder:
            tasks = (Task.EMBED, Task.RERANK) if mode in _EMBEDDER_SCORES else (Task.EMBED,)
            out.setdefault(info.embedder, ServedModel(info.embedder, tasks, info.embedder_max_tokens))
        for task, (_, field, _) in _POOLERS.items():
            name = getattr(info, field)
            if name:
                out.setdefault(name, ServedModel(name, (task,), getattr(info, f"{field}_max_tokens")))
        if self.rerank_model:
            out.setdefault(self.rerank_model, ServedModel(self.rerank_model, (Task.RERANK,),
                                                          info.rerank_max_pair_tokens))
        return list(out.values())

    def model_tasks(self) -> dict[str, tuple[Task, ...]]:
        """Each listed model's id and what it does, the served LLM's names first."""
        return {m.name: m.tasks for m in self.models()}

    def _known(self, model: str) -> tuple[Task, ...] | None:
        """What the model a request names does; None: no model of this replica (an alias of the LLM, the path as
        given, counts as the LLM)."""
        tasks = self.model_tasks()
        if model in tasks:
            return tasks[model]
        return tasks[self.info.model] if model and model in self._accepted else None

    def _check_task(self, model: str, task: Task) -> None:
        """A request naming a model this replica serves for something else (an embedding sent to the chat model's
        name, a chat to the embedder's) is refused, never served by another model under the name it gave: 400
        naming the models that do its kind. Backwards compatible: a rerank naming the LLM where the LLM does not
        score is scored by the reranker (/v1/models listed the LLM as a reranker until issue 72), unless names are
        strict."""
        known = self._known(model)
        if known is None or task in known:
            return
        if task is Task.RERANK and Task.GENERATE in known and not self._strict:
            return
        raise invalid(f"model {model!r} does not {_VERBS[task]}: it is served to {' and '.join(_VERBS[t] for t in known)}"
                      f"; {self._who(task)}")

    def _who(self, task: Task) -> str:
        """Which models do `task`, for a refusal."""
        able = [m.name for m in self.models() if task in m.tasks]
        if not able:
            return "this replica serves none that does"
        return f"send it to {' or '.join(repr(n) for n in able)} (or leave model empty)"

    def check_model(self, model: str) -> None:
        if model not in self._accepted:
            raise ServiceError(ErrorKind.NOT_FOUND,
                               f"model {model!r} is not served by this replica; it serves "
                               f"{list(self.info.served_names)} (leave model empty for the default)")

    def _check_served(self, model: str, task: Task) -> None:
        """A rerank or an embedding naming no model of this replica is served by the one that does its kind anyway
        (as TEI does), unless names are strict: then NOT_FOUND naming the models that do."""
        if self._strict and model and self._known(model) is None:
            able = [m.name for m in self.models() if task in m.tasks]
            raise ServiceError(ErrorKind.NOT_FOUND, f"model {model!r} is not served by this replica; it serves "
                                                    f"{able} for {_VERBS[task]} (leave model empty for it)")

    def model_name(self, model: str) -> str:
        """The name a response echoes: the one the client gave, else the served model's."""
        return model or self.info.model

    # ---- generation ------------------------------------------------------------------------------

    def refused(self, kind: SeqKind | str, request_id: str, metadata: dict[str, str], error: ServiceError) -> None:
        """A request refused before the engine admitted it (by these checks, or by a door's own): the lifecycle
        hooks hear of it (the access log writes its line)."""
        self.bridge.refused(request_id, str(kind), metadata, error.kind.name, error.message)

    def refused_at_door(self, kind: str, metadata: dict[str, str], status: str) -> None:
        """A request a door refused on its own terms (an HTTP body that does not parse, a wrong Content-Type, a
        missing token), with the status the door answered."""
        self.bridge.refused("", kind, {**metadata, "status": status}, None)

    @staticmethod
    def _named(metadata: dict[str, str], model: str, default: str) -> dict[str, str]:
        """The request's metadata with the model it named (else the one its kind is served by), for the access log of
        a request refused before it ran: a refused name is logged as given."""
        return {**metadata, "model": model or default}

    @staticmethod
    def _worked(metadata: dict[str, str], model: str, worker: str) -> dict[str, str]:
        """The metadata of an admitted request, for the access log and its span: `model` the model that does the
        work (the scorer of a rerank, the embedder, the LLM's served name), `requested_model` what the request
        named where that was another name."""
        out = {**metadata, "model": worker}
        if model and model != worker:
            out["requested_model"] = model
        return out

    @contextlib.contextmanager
    def _admitting(self, kind: SeqKind, request_id: str, metadata: dict[str, str]) -> Iterator[None]:
        try:
            yield
        except ServiceError as exc:
            self.refused(kind, request_id, metadata, exc)
            raise

    def generate(self, inputs: Sequence[GenerateInput], metadata: dict[str, str], *,
                 relayed: bool = False) -> GenerationStream:
        """Admit every input (all or none: a refusal aborts those admitted before it and raises ServiceError);
        their outputs arrive through the returned stream, bounded by --max-stream-buffer-bytes. `relayed`: the
        caller moves each event at once into a bounded channel of its own (the gRPC door's stream session), which
        is then the one bound, so the returned stream counts nothing (GenerationStream)."""
        stream = GenerationStream(self.bridge, None if relayed else self.limits.max_stream_buffer_bytes)
        named = inputs[0].model if inputs else ""
        # An accepted name is one of the LLM's (an alias, the path as given): its served name did the work.
        metadata = self._worked(metadata, named, self.info.model) if named in self._accepted else \
            self._named(metadata, named, self.info.model)
        try:
            for index, inp in enumerate(inputs):
                self._check_generate(inp)
                spec = GenerateSpec(new_request_id(SeqKind.GENERATE), inp.prompt, inp.params, messages=inp.messages,
                                    tools=inp.tools)
                lc = self.bridge.submit(spec, inp.request_id, stream.sink(index, inp.request_id),
                                        timeout_ms=inp.timeout_ms, metadata=metadata, owner=owner(metadata))
                stream._admitted(inp.request_id, lc)
        except ServiceError as exc:
            stream.abort()
            self.refused(SeqKind.GENERATE, inputs[0].request_id if inputs else "", metadata, exc)
            raise
        return stream

    def _check_generate(self, inp: GenerateInput) -> None:
        """What the request names; its input (none, both, empty) is the engine intake's to check."""
        self._check_task(inp.model, Task.GENERATE)
        self.check_model(inp.model)
        _check_roles(inp.messages)

    def tool_plan(self, tools: list[dict] | None, tool_choice: str | dict | None,
                  parallel: bool | None = None) -> ToolPlan | None:
        """What a request's tools and tool_choice ask for (service/tool_calls.py), with the served model's tool format
        and template; INVALID_ARGUMENT naming what is wrong (a template that renders no tools names the shipped ones
        that do). A door puts the plan's template_tools in GenerateInput.tools and its structured_outputs in the
        params, and reads the output back with plan.reader()."""
        try:
            return plan_tools(tools, tool_choice, parallel, self.tools)
        except ValueError as exc:
            raise invalid(str(exc)) from None

    def abort(self, engine_id: str) -> None:
        self.bridge.abort(engine_id)

    # ---- rerank ----------------------------------------------------------------------------------

    async def rerank(self, inp: RerankInput, metadata: dict[str, str]) -> RerankOutcome:
        """Score inp's documents; raises ServiceError. Cancelling the await aborts the engine job."""
        scorer = self.rerank_name
        with self._admitting(SeqKind.RERANK, inp.request_id, self._named(metadata, inp.model, scorer)):
            self._check_task(inp.model, Task.RERANK)
            self._check_served(inp.model, Task.RERANK)
            if inp.max_tokens_per_doc is not None and inp.max_tokens_per_doc < 1:
                raise invalid(f"max_tokens_per_doc must be >= 1, got {inp.max_tokens_per_doc}")
        metadata = self._worked(metadata, inp.model, scorer)
        params = inp.params
        if inp.max_tokens_per_doc is not None:  # cut where the engine tokenizes the documents anyway (once)
            params = replace(params, max_document_tokens=inp.max_tokens_per_doc)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        with self._admitting(SeqKind.RERANK, inp.request_id, metadata):
            lc = self.bridge.submit(RerankSpec(new_request_id(SeqKind.RERANK), inp.query, inp.documents, params),
                                    inp.request_id, lambda event: future.done() or future.set_result(event),
                                    timeout_ms=inp.timeout_ms, metadata=metadata, owner=owner(metadata))
        event: RerankOutput = await self._final(future, lc, "rerank", inp.cut_hint)
        params = inp.params
        results = rank_scores(event.scores, inp.documents, params.top_n, params.return_documents,
                              event.document_tokens, event.truncated, event.windows)
        return RerankOutcome(inp.request_id, results, Usage.of(lc), self.info.rerank_mode, id=lc.engine_id,
                             model=scorer)

    async def _final(self, future: asyncio.Future, lc: RequestLifecycle, what: str, cut_hint: str
                     ) -> RerankOutput | EmbedOutput:
        """The one final output of an admitted rerank or embed job; cancelling the await (the client left, its
        deadline passed) aborts the job. Raises its ServiceError (an input too long says how to ask, in the
        request's own API, for the cut: `cut_hint`), or UNAVAILABLE if the server aborted it."""
        try:
            event = await future
        except asyncio.CancelledError:  # its client left (a door cancels the call when it hears of that)
            lc.metadata[CLIENT_GONE] = "1"
            raise
        finally:
            if not future.done() or future.cancelled():
                self.bridge.abort(lc.engine_id)
        if isinstance(event, ServiceError):
            if event.too_long:
                raise ServiceError(event.kind, f"{event.message} or {cut_hint}") from None
            raise event
        if event.finish_reason is FinishReason.ABORT:  # aborted by the server (drain timeout)
            raise ServiceError(ErrorKind.UNAVAILABLE, f"{what} aborted: the server is shutting down; retry")
        return event

    # ---- embeddings ------------------------------------------------------------------------------

    async def embed(self, inp: EmbedInput, metadata: dict[str, str]) -> EmbedOutcome:
        """One vector per input; raises ServiceError. Cancelling the await aborts the engine job. A request naming
        another model is embedded by the one embedder anyway (as a rerank is scored), unless names are strict."""
        embedder = self.info.embedder
        with self._admitting(SeqKind.EMBED, inp.request_id, self._named(metadata, inp.model, embedder)):
            self._check_task(inp.model, Task.EMBED)
            self._check_served(inp.model, Task.EMBED)
        metadata = self._worked(metadata, inp.model, embedder)
        with self._admitting(SeqKind.EMBED, inp.request_id, metadata):
            future: asyncio.Future = asyncio.get_running_loop().create_future()
            lc = self.bridge.submit(EmbedSpec(new_request_id(SeqKind.EMBED), inp.inputs, inp.params),
                                    inp.request_id, lambda event: future.done() or future.set_result(event),
                                    timeout_ms=inp.timeout_ms, metadata=metadata, owner=owner(metadata))
        event: EmbedOutput = await self._final(future, lc, "embed", inp.cut_hint)
        return EmbedOutcome(inp.request_id, event.embeddings, event.truncated, Usage.of(lc), self.info.embedder,
                            id=lc.engine_id)

    # ---- classification and sparse embeddings: the embedding job on another encoder ------------------

    async def classify(self, inp: EmbedInput, metadata: dict[str, str]) -> ClassifyOutcome:
        """Label probabilities per input from the classifier (--classifier); raises ServiceError (INVALID_ARGUMENT
        naming the flag where none is loaded)."""
        event, lc, model = await self._pool(inp, metadata, Task.CLASSIFY)
        return ClassifyOutcome(inp.request_id, event.embeddings, tuple(self.info.classifier_labels), event.truncated,
                               Usage.of(lc), model, id=lc.engine_id)

    async def embed_sparse(self, inp: EmbedInput, metadata: dict[str, str]) -> SparseOutcome:
        """A SPLADE sparse vector per input from the sparse embedder (--sparse-embedder); raises ServiceError."""
        event, lc, model = await self._pool(inp, metadata, Task.EMBED_SPARSE)
        return SparseOutcome(inp.request_id, [[(int(i), float(v)) for i, v in vec] for vec in event.embeddings],
                             event.truncated, Usage.of(lc), model, id=lc.engine_id)

    async def _pool(self, inp: EmbedInput, metadata: dict[str, str], task: Task
                    ) -> tuple[EmbedOutput, RequestLifecycle, str]:
        """An embedding job whose rows run on `task`'s encoder: its final output, lifecycle and model id."""
        pooling, field, flag = _POOLERS[task]
        model = getattr(self.info, field)
        with self._admitting(SeqKind.EMBED, inp.request_id, self._named(metadata, inp.model, model)):
            if not model:
                raise invalid(f"this server has no {field.replace('_', ' ')}: start it with {flag} DIR|HUB_ID to "
                              f"serve {_VERBS[task]}")
            self._check_task(inp.model, task)
            self._check_served(inp.model, task)
        metadata = self._worked(metadata, inp.model, model)
        params = replace(inp.params, task=pooling)
        with self._admitting(SeqKind.EMBED, inp.request_id, metadata):
            future: asyncio.Future = asyncio.get_running_loop().create_future()
            lc = self.bridge.submit(EmbedSpec(new_request_id(SeqKind.EMBED), inp.inputs, params),
                                    inp.request_id, lambda event: future.done() or future.set_result(event),
                                    timeout_ms=inp.timeout_ms, metadata=metadata)
        event: EmbedOutput = await self._final(future, lc, _VERBS[task], inp.cut_hint)
        return event, lc, model

    # ---- tokens ----------------------------------------------------------------------------------

    async def tokenize(self, *, prompt: str | None = None, messages: list[dict[str, str]] | None = None,
                       add_special_tokens: bool = True, model: str = "") -> list[int]:
        """A prompt's token ids (as a generation would have them), or a chat's as the chat template renders it for
        a reply; on a worker thread. Raises ServiceError."""
        self.check_model(model)
        _check_roles(messages)
        try:
            if prompt is not None and not add_special_tokens:
                if not prompt:
                    raise ValueError("prompt must not be empty")
                return await asyncio.to_thread(_plain_ids, self._tokenizer, prompt)
            return await self.bridge.prompt_token_ids(prompt, messages)
        except ValueError as exc:
            raise invalid(str(exc)) from None

    async def detokenize(self, token_ids: list[int], *, model: str = "") -> str:
        self.check_model(model)
        vocab = self.info.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise invalid(f"tokens must be token ids in [0, {vocab})")
        return await asyncio.to_thread(self._tokenizer.decode, token_ids)

    async def stats(self) -> dict:
        return await self.bridge.stats()

    # ---- draining --------------------------------------------------------------------------------

    def drain(self) -> None:
        """Refuse new work from now on (UNAVAILABLE through either door); in-flight work goes on."""
        self.bridge.draining = True

    @property
    def num_live(self) -> int:
        return self.bridge.num_live

    async def wait_idle(self) -> None:
        await self.bridge.wait_idle()

    def abort_all(self) -> None:
        self.bridge.abort_all()


def owner(metadata: dict[str, str]) -> str:
    """The client a request counts against for its share of --max-waiting (EngineBridge.fair_share), as its door
    names it: the gRPC stream it came on, else its peer (a gRPC connection's unary calls, an HTTP connection)."""
    return metadata.get("stream") or metadata.get("peer", "")


def short_name(model: str) -> str:
    """A model's default id: a GGUF file's stem, a directory's name, the embedded model's name."""
    if model.endswith(EMBEDDED_SUFFIX):
        return model[:-len(EMBEDDED_SUFFIX)]
    path = model.rstrip("/")
    name = os.path.basename(path) or path
    return name[:-len(".gguf")] if name.lower().endswith(".gguf") else name


EMBEDDED_SUFFIX = " (embedded)"  # how engine.model_info() names the embedded model


def json_schema(text: str, where: str) -> dict:
    """A schema given as JSON text (gRPC's json_schema, HTTP's guided_json string): it must parse and be an
    object. Raises ValueError naming `where`."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; deep nesting recurses
        message = str(exc)
        raise ValueError(f"{where} is not valid JSON: {message[:200] + '...' if len(message) > 200 else message}"
                         ) from None
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON object (a schema), got {type(schema).__name__}")
    return schema


def _check_roles(messages: list[dict[str, str]] | None) -> None:
    """A chat's roles, the same for a generation and for /tokenize."""
    for i, m in enumerate(messages or ()):
        if not m.get("role"):
            raise invalid(f"messages[{i}].role must not be empty (e.g. 'system', 'user', 'assistant')")
        if m["role"] not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {m['role']!r}")


def _plain_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


__all__ = ["new_request_id", "CHAT_ROLES", "CoreAPI", "GRPC_CUT_HINT", "Task", "EmbedInput", "EmbedOutcome", "GenerateEvent", "GenerateInput", "GenerationStream", "Limits", "ModelInfo",
           "Names", "RerankInput", "RerankOutcome", "ServedModel", "Usage", "json_schema", "short_name"]
