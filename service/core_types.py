"""The small dataclasses the core API takes and returns (beside the engine's own types): what one request may ask
for (`Limits`), what its `model` may say (`Names`), what this replica serves (`ModelInfo`, `ServedModel`), the inputs
of each kind of request and their outcomes (one for every kind an encoder of its own serves), and the usage every outcome carries."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import MAX_LOGPROBS, MAX_N, EmbedParams, RerankParams, SamplingParams
from engine.outputs import RerankResult, TokenDelta, check_top_n
from service.errors import ServiceError
from service.kinds import Task
from service.lifecycle import RequestLifecycle

DEFAULT_MAX_BUFFER_BYTES = 16 * 2**20


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
    # Each kind with an encoder of its own (service/kinds.py pooled(): a classifier, a sparse embedder) -> that
    # encoder; a kind whose flag was not given has an empty one.
    encoders: dict[Task, "Encoder"] = field(default_factory=dict)

    def encoder(self, task: Task) -> "Encoder":
        """The encoder serving kind `task` (empty: none loaded)."""
        return self.encoders.get(task, Encoder())


@dataclass(frozen=True, slots=True)
class Encoder:
    """An encoder of a kind's own (ModelInfo.encoders): its id ("": none loaded; the kind's flag loads one), the most
    tokens one input may have, and its labels, id order, where it has any (a classifier's id2label)."""
    name: str = ""
    max_tokens: int = 0
    labels: tuple[str, ...] = ()

    @classmethod
    def of(cls, engine_info: dict, field_name: str) -> "Encoder":
        """What engine.model_info says of the encoder its EngineConfig field `field_name` names."""
        return cls(str(engine_info.get(field_name) or ""), int(engine_info.get(f"{field_name}_max_tokens") or 0),
                   tuple(engine_info.get(f"{field_name}_labels") or ()))


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
    """One rerank: what the engine scores (`params`), and how the answer is shaped, applied here at the service's
    edge (`top_n`, `return_documents`: the engine never sees them). ValueError for a top_n below 1."""
    request_id: str
    query: str
    documents: list[str]
    params: RerankParams
    model: str = ""
    timeout_ms: int = 0
    max_tokens_per_doc: int | None = None  # cut each document to its first N tokens before scoring (Cohere)
    cut_hint: str = GRPC_CUT_HINT  # how this request's API asks to cut a document too long (completes the refusal)
    top_n: int | None = None  # the answer's best N (None: every document)
    return_documents: bool = False  # each result carries its document's text

    def __post_init__(self) -> None:
        check_top_n(self.top_n)


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
class PooledOutcome:
    """The outcome of a kind served by an encoder of its own (CoreAPI.pool): per input, input order, what its row
    became (engine/embed/tasks.py: a classifier's probability per label, id order, or its logits with raw_scores; a
    sparse embedder's non-zero (vocabulary id, weight) pairs, id order)."""
    request_id: str
    outputs: list[list]
    labels: tuple[str, ...]  # the encoder's labels, id order (a classifier's; () where it has none)
    truncated: list[bool]
    usage: Usage
    model: str  # the encoder's id
    id: str = ""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model this replica serves and the kinds of work it does (HTTP /v1/models, gRPC ModelInfo.models), the
    served LLM's names first; `max_tokens`: its input limit (the LLM's context, the embedder's input, a
    cross-encoder's pair)."""
    name: str
    tasks: tuple[Task, ...]
    max_tokens: int
