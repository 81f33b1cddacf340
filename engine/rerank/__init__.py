"""Reranking in one place: a rerank mode (PairScorer) turns (query, document) pairs into tokens and their forward
into scores; RerankJob tracks one request's pairs. The scheduler sees pairs only as prefill-only sequences."""
from __future__ import annotations

from engine.config import EngineConfig, RerankMode
from engine.rerank.job import RerankJob
from engine.rerank.pairs import PairTemplate, PairTokens
from engine.rerank.recipes import recipe_from_dir, resolve
from engine.rerank.scorer import PairPhase, PairScorer
from engine.settings import Settings

# The default mode for a causal LM: query likelihood measured best of the LLM-only modes on the retrieval-quality
# benchmark. With an embedder loaded: dense, which ranks within one standard error of fusion (the default before it)
# on both corpora at 128-512 tokens for a fraction of the cost, no LLM pair (issue #47; bench/rerank_quality.py and
# bench/rerank_serve.py, figures in docs/reranking.md "Choosing a mode").
DEFAULT_LLM_MODE = RerankMode.LIKELIHOOD
DEFAULT_WITH_EMBEDDER = RerankMode.DENSE

__all__ = ["PairPhase", "PairScorer", "PairTemplate", "PairTokens", "RerankJob", "build_scorer", "default_mode",
           "DEFAULT_LLM_MODE", "DEFAULT_WITH_EMBEDDER"]


def default_mode(config: EngineConfig) -> RerankMode:
    """The mode `config` runs: rerank_mode when set, else a cross-encoder when one is given, else the judge when a
    reranker recipe is named or the model directory declares one (an LLM reranker), else dense when an embedder is
    loaded, else query likelihood."""
    if config.rerank_mode is not None:
        return config.rerank_mode
    if config.reranker:
        return RerankMode.CROSS_ENCODER
    if config.rerank_recipe is not None or config.rerank_template or recipe_from_dir(config.model) is not None:
        return RerankMode.JUDGE  # an LLM reranker: the model is there to rerank by its recipe
    return DEFAULT_WITH_EMBEDDER if config.embedder else DEFAULT_LLM_MODE


def build_scorer(config: EngineConfig, tokenizer, model, settings: Settings, shared: bool = False) -> PairScorer:
    """The rerank mode `config` asks for (rerank_mode, or the default for what is loaded); `settings`: where the
    embedded model is cached, which attention backend a cross-encoder runs; `shared`: the embedder is the
    cross-encoder's own encoder (engine/builder.py), so the cross-encoder's forward gives every token's state."""
    mode = default_mode(config)
    if mode is RerankMode.CROSS_ENCODER:
        from engine.models.encoder_loader import CrossEncoder, resolve_encoder_dtype
        from engine.models.loader import resolve_model_dir
        from engine.rerank.cross_encoder import CrossEncoderScorer

        dtype = resolve_encoder_dtype(config.encoder_dtype, config.dtype, config.device, settings.native_bf16)
        encoder = CrossEncoder.from_pretrained(resolve_model_dir(config.reranker, settings.cache_dir,
                                                                 config.reranker_revision), config.device,
                                               dtype, settings.kernels, shared=shared)
        return CrossEncoderScorer(encoder)
    if mode is RerankMode.JUDGE:
        from engine.rerank.judge import JudgeScorer

        recipe, template = resolve(config.rerank_recipe, config.rerank_template, config.model)
        return JudgeScorer(tokenizer, model, recipe, template)
    if mode is RerankMode.FUSION:
        from engine.rerank.fusion import FusionScorer

        return FusionScorer(tokenizer)
    if mode is RerankMode.DENSE:
        from engine.rerank.dense import DenseScorer

        return DenseScorer()
    if mode is RerankMode.CASCADE:
        from engine.rerank.cascade import CascadeScorer

        return CascadeScorer(tokenizer, config.rerank_cascade_k)
    from engine.rerank.likelihood import LikelihoodScorer

    return LikelihoodScorer(tokenizer)
