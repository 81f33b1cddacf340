"""Building an engine: load the model and tokenizer, size the KV pool, pick the rerank mode, capture CUDA graphs."""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import kernels
from kernels import quant

from engine import chat_templates
from engine.admission import AdmissionPolicy, policy_for
from engine.config import EMBEDDED_EMBEDDER, EngineConfig, PoolingTask, RerankMode
from engine.cuda_graphs import capture_sizes, cuda_graph_capture
from engine.embed import Embedder, embedded_embedder_dir
from engine.embed.tasks import with_heads
from engine.kv_cache import BlockPool, KVCacheManager
from engine.models import gguf_file
from engine.models.decoder import DecoderForCausalLM
from engine.models.decoder_args import DecoderArgs
from engine.models.decoder_walker import narrow_rows
from engine.models.decoder_weights import Weight, build_decoder
from engine.models.encoder_loader import same_encoder
from engine.models import hub
from engine.models.loader import (ModelSource, default_model_dir, load_state_dict, read_config, resolve_model,
                                  resolve_model_dir)
from engine.models.quantized import (int8_activation_formats, layer_formats, quantize_state_int8, resolve_quantization,
                                     weight_bytes, weight_format)
from kernels.quant import QuantWeight
from engine.rerank import PairScorer, build_scorer, default_mode
from engine.rerank.recipes import resolve as resolve_recipe
from engine.runner import DTYPES, ModelRunner
from engine.scheduler import Scheduler
from engine.settings import Settings
from engine.staged_states import StagedStates

log = logging.getLogger("tandem.engine")
# The trained reranker the start-up line and docs/reranking.md point to (a Hub id, fetched when asked for)
SUGGESTED_RERANKER = "BAAI/bge-reranker-v2-m3"


@dataclass(slots=True)
class EngineParts:
    """Everything a running engine needs, built once from an EngineConfig."""
    model_dir: str
    tokenizer: object
    hf_config: dict
    model_args: DecoderArgs
    model: DecoderForCausalLM
    max_model_len: int
    max_model_len_by: str  # what sets max_model_len (the model, the config, or the KV pool), named in errors
    pool: BlockPool
    kv: KVCacheManager
    staged: StagedStates  # encoder rows' states between their stages: the scheduler frees them, the runner fills them
    admission: AdmissionPolicy  # the scheduler's; the engine asks it for step-time predictions and feeds it records
    scheduler: Scheduler
    scorer: PairScorer
    # Every pooling encoder loaded, by the task its rows do (the embedder's EMBED, a classifier, a sparse embedder):
    # their one owner (`embedder` reads poolers[PoolingTask.EMBED])
    poolers: dict[PoolingTask, Embedder]
    runner: ModelRunner
    eos_token_ids: set[int]
    quantization: str  # "gguf" | "int8" | "none" (see EngineConfig.quantization)
    weight_bytes: int
    weight_format: str
    cpu_kernels: str  # the CPU path the quantized matmuls take ("avx512", "avx2", "portable"); "" when none do
    narrow_rows: int | None  # LLM rows a step may have and keep every matmul on its narrow kernel (None: no limit)


class _NoLengthWarning(logging.Filter):
    """Drops transformers' "Token indices sequence length is longer than the specified maximum sequence length for
    this model (... > 256). Running this sequence through the model will result in indexing errors": the engine
    checks every input's length itself (refused or cut, as the request says) before a model sees it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Token indices sequence length is longer than")


_LENGTH_WARNING = _NoLengthWarning()


def build_engine_parts(config: EngineConfig, admission: AdmissionPolicy | None = None,
                       settings: Settings | None = None) -> EngineParts:
    """`admission`: the policy the scheduler runs (None: the one config names). The one place an engine's admission
    policy is resolved (engine/admission.py policy_for), before anything slow is loaded. `settings`: the process
    settings (None: read from the environment here, once: engine/settings.py)."""
    logging.getLogger("transformers.tokenization_utils_base").addFilter(_LENGTH_WARNING)  # once: a set of filters
    settings = settings or Settings.from_env()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    source = resolve_model(config.model, settings.cache_dir, config.revision, config.gguf_file)
    model_dir = source.meta_dir
    quantization = resolve_quantization(config, source.gguf is not None)
    quantized = quantization in ("gguf", "int8")
    # The CPU path this engine's quantized matmuls take, resolved once here and held by its model (kernels/quant.py
    # CpuPath); a dense model never builds the C++ module to ask.
    cpu_path = (quant.resolve_cpu_path(settings.cpu_isa, settings.quant_small_m, settings.native_bf16) if quantized
                else None)
    if admission is not None:
        policy_for(config, admission)  # a policy object that is none is refused before anything slow is loaded
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if source.gguf is not None:
        _mark_markup_tokens_special(tokenizer)
    if config.chat_template is not None:
        tokenizer.chat_template = _chat_template(config.chat_template, tokenizer)
    hf_config = read_config(model_dir)
    if not tokenizer.chat_template:
        log.warning("the model has no chat template (a base model): chat requests are refused until one is given: "
                    "%s", chat_templates.suggestion(hf_config.get("model_type")))
    args = DecoderArgs.from_hf_config(hf_config)
    weights = _load_weights(source, args, quantization, settings.cache_dir)
    model = build_decoder(args, weights, config.device, DTYPES[config.dtype],
                          quant.Activations(config.cpu_activations), settings, cpu_path)
    # The quantized CPU matmuls leave their narrow kernels above the model's narrow_rows (the one owner of that width):
    # a fixed cost the objective's step-time model gets as its own feature, and the width calibration sweeps past.
    narrow = narrow_rows(model) if quantized else None
    policy = policy_for(config, admission, wide_rows=narrow)
    cpu_kernels = quant.kernel_path(cpu_path) if quantized else ""
    if cpu_kernels and config.cpu_activations == "int8":
        if not quant.int8_activations_available(cpu_path):
            raise ValueError(f"cpu_activations='int8' needs the avx2 or avx512 CPU path; this engine's is {cpu_kernels}")
        cpu_kernels += " int8-activations"
    elif cpu_kernels and config.cpu_activations == "auto" and quant.int8_activations_available(cpu_path):
        int8_formats = int8_activation_formats(model)  # the K-quants among the model's formats (none: all float32)
        if int8_formats:
            cpu_kernels += f" int8-activations({'+'.join(int8_formats)})"
    if "int8-activations" in cpu_kernels and cpu_path.bf16_gemm:
        cpu_kernels += " bf16-wide"  # their steps past the int8 kernel's width multiply bf16 (kernels/quant.py)
    prefill = (quant.prefill_path(cpu_path, quant.Activations(config.cpu_activations), layer_formats(model))
               if cpu_kernels else "")
    log.info("weights: %s, %.1f MB%s%s", weight_format(model), weight_bytes(model) / 1e6,
             f", CPU kernels: {cpu_kernels}" if cpu_kernels else "", f", prefill: {prefill}" if prefill else "")
    max_model_len = min(config.max_model_len or args.max_position_embeddings, args.max_position_embeddings)
    max_model_len_by = ("max_model_len (tandem serve --max-model-len)" if max_model_len < args.max_position_embeddings
                        else "the model's context, max_position_embeddings")
    per_block = ModelRunner.kv_bytes_per_block(args, config.block_size, config.dtype)
    num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // per_block)
    # A sequence must fit the whole pool, or it would be preempted forever once it outgrew it.
    if num_blocks * config.block_size < max_model_len:
        max_model_len = num_blocks * config.block_size
        max_model_len_by = "the KV cache (tandem serve --kv-cache-bytes / --num-kv-blocks)"
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, config.block_size, config.enable_prefix_caching)
    staged = StagedStates()
    shared = _shared_encoder(config, settings)
    scorer = build_scorer(config, tokenizer, model, settings, shared=shared)
    embedder = (Embedder.load(config.embedder, config.device, config.dtype, settings,
                              scorer.encoder if shared else None, config.encoder_dtype, config.embedder_revision)
                if config.embedder else None)
    poolers = {PoolingTask.EMBED: embedder} if embedder is not None else {}
    for kind in with_heads():  # engine/embed/tasks.py: a classifier, a sparse embedder
        name = getattr(config, kind.field)
        if name:  # its own encoder beside the embedder; its rows ride the same steps as embedding rows
            task = kind.task
            poolers[task] = Embedder.load(name, config.device, config.dtype, settings,
                                          encoder_dtype=config.encoder_dtype, task=task)
            log.info("%s %s (%s) in %s", task.value, poolers[task].name, poolers[task].architecture,
                     poolers[task].dtype)
    runner = ModelRunner(model, num_blocks, config.block_size, config.device, config.dtype, scorer,
                         eos_token_ids=_eos_ids(hf_config, tokenizer), poolers=poolers)
    kernels.prepare(config.device, DTYPES[config.dtype], settings.kernels)
    if runner.device.type == "cuda" and not config.enforce_eager:
        started = time.monotonic()
        if runner.capture_decode_graphs(capture_sizes(config.max_num_seqs),
                                        -(-max_model_len // config.block_size), cuda_graph_capture()):
            log.info("captured decode CUDA graphs for batch sizes %s in %.1f s",
                     runner.decode_graphs.sizes, time.monotonic() - started)
    log.info("%s", describe_engine(config, runner.device, cpu_kernels, scorer.mode, embedder, max_model_len,
                                   args.max_position_embeddings, max_model_len_by))
    return EngineParts(model_dir=str(model_dir), tokenizer=tokenizer, hf_config=hf_config, model_args=args,
                       model=model, max_model_len=max_model_len,
                       max_model_len_by=max_model_len_by, pool=pool, kv=kv, staged=staged, admission=policy,
                       scheduler=Scheduler(config, kv, policy, staged=staged), scorer=scorer, poolers=poolers,
                       runner=runner,
                       eos_token_ids=_eos_ids(hf_config, tokenizer), quantization=quantization,
                       weight_bytes=weight_bytes(model), weight_format=weight_format(model),
                       cpu_kernels=cpu_kernels, narrow_rows=narrow)


def describe_engine(config: EngineConfig, device: torch.device, cpu_kernels: str, rerank_mode: RerankMode,
                    embedder: Embedder | None, max_model_len: int, model_context: int, max_model_len_by: str) -> str:
    """The start-up line that says what this engine runs on and what bounds it: device, threads, the C++ kernels'
    CPU path, how reranks are scored (fusion: which two models), and the context length with what capped it."""
    llm = Path(config.model).name if config.model else "SmolLM2-135M-Instruct"
    judge = (f"{llm} by the {resolve_recipe(config.rerank_recipe, config.rerank_template, config.model)[0]} reranker "
             "recipe") if RerankMode(rerank_mode) is RerankMode.JUDGE else ""
    scored_by = {RerankMode.LIKELIHOOD: f"{llm}'s query likelihood", RerankMode.JUDGE: judge,
                 RerankMode.CROSS_ENCODER: f"the cross-encoder {Path(str(config.reranker)).name}",
                 RerankMode.FUSION: f"{embedder.name if embedder else 'the embedder'}'s cosine + {llm}'s query "
                                    "likelihood",
                 # the same cosine a retriever using this embedder ranked by: say so where the user meets it
                 RerankMode.DENSE: f"{embedder.name if embedder else 'the embedder'}'s cosine: documents retrieved "
                                   "by this embedder come back in their retrieval order; a trained cross-encoder is "
                                   f"--reranker {SUGGESTED_RERANKER}",
                 RerankMode.CASCADE: f"{embedder.name if embedder else 'the embedder'}'s cosine, then {llm}'s query "
                                     f"likelihood fused for its top {config.rerank_cascade_k}"}[RerankMode(rerank_mode)]
    where = f"device {device}" + (f", {torch.get_num_threads()} threads" if device.type == "cpu" else "")
    if device.type == "cpu":
        where += f", CPU kernels {cpu_kernels}" if cpu_kernels else ", CPU kernels none (dense weights: torch matmuls)"
    if embedder is not None:
        where += f", embedder in {embedder.dtype}"  # EngineConfig.encoder_dtype as resolved on this CPU
    context = (f"context {max_model_len:,} tokens ({max_model_len_by})" if max_model_len == model_context else
               f"context {max_model_len:,} of the model's {model_context:,} tokens, capped by {max_model_len_by}")
    return f"{where}; rerank: {rerank_mode} ({scored_by}); {context}"


def _shared_encoder(config: EngineConfig, settings: Settings) -> bool:
    """The cross-encoder and the embedder are one encoder (encoder_loader.same_encoder): one copy of its weights
    serves both, and a step's pairs and embedding inputs run in one forward (engine/runner.py)."""
    if default_mode(config) is not RerankMode.CROSS_ENCODER or not config.embedder or not config.reranker:
        return False
    embedder = (embedded_embedder_dir() if config.embedder == EMBEDDED_EMBEDDER
                else Path(hub.local_path(config.embedder, "--embedder", config.embedder_revision)).expanduser())
    shared = embedder.is_dir() and same_encoder(
        resolve_model_dir(config.reranker, settings.cache_dir, config.reranker_revision), embedder)
    if shared:
        log.info("the cross-encoder and the embedder are one encoder: one copy of it serves both, in one forward")
    return shared


def _load_weights(source: ModelSource, args: DecoderArgs, quantization: str, cache: Path) -> dict[str, Weight]:
    """HF-named weights as the chosen quantization holds them: a GGUF file's blocks as stored ("gguf"), dense
    ("none": a directory's safetensors, or a GGUF file dequantized once here), or per-channel int8 ("int8")."""
    if source.gguf is not None and (quantization == "gguf" or not source.embedded):
        weights = gguf_file.load_gguf(source.gguf, cache)
        if quantization == "gguf":
            return weights
        weights = {k: w.dequantize() if isinstance(w, QuantWeight) else w for k, w in weights.items()}
    elif source.embedded:  # its dense float32 conversion, made on first use (~540 MB under TANDEM_CACHE_DIR)
        weights = load_state_dict(default_model_dir(cache))
    else:  # a Hugging Face directory
        weights = load_state_dict(source.meta_dir)
    if quantization == "int8":
        return quantize_state_int8(weights, args.tie_word_embeddings)
    return weights


# A GGUF marks control tokens (EOS, <start_of_turn>) as such, and transformers makes them special; tokens the model's
# own tokenizer calls special but the GGUF stores as "user defined" (Gemma 3's <start_of_image>, <end_of_image>) come
# out as plain added tokens. Those named like <word_word> are made special again, so skip_special_tokens leaves them
# out of the text as it does with the original tokenizer; markup without an underscore (<table>, </td>) stays text.
# Tool-call markers stay text: the model's own tokenizer does not call them special (Qwen 2.5 / Qwen 3, Hermes), and
# the tool-call parser reads them in the reply (service/tool_calls.py), which skip_special_tokens would empty.
_MARKUP_TOKEN = re.compile(r"<[a-z]+(?:_[a-z]+)+>")
TEXT_MARKERS = frozenset({"<tool_call>", "<tool_response>"})


def _mark_markup_tokens_special(tokenizer) -> None:
    markup = [token.content for token in tokenizer.added_tokens_decoder.values()
              if not token.special and _MARKUP_TOKEN.fullmatch(token.content) and token.content not in TEXT_MARKERS]
    if markup:
        tokenizer.add_tokens(markup, special_tokens=True)


def _chat_template(given: str, tokenizer) -> str:
    """The template text of a shipped template's name (engine/chat_templates.py), a file's path or the template
    itself, checked by rendering one user turn: a template that does not render is refused at start-up, not at the
    first chat."""
    text = chat_templates.template_text(given)
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=text, tokenize=False,
                                      add_generation_prompt=True)
    except Exception as exc:  # jinja2's TemplateError and whatever the template raises
        raise ValueError(f"chat_template does not render one user message (--chat-template): {exc}") from None
    return text


def _eos_ids(hf_config: dict, tokenizer) -> set[int]:
    ids = hf_config.get("eos_token_id")
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
